{{/* The release's resource name, at most 63 characters. */}}
{{- define "binx.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select this release's worker pods. */}}
{{- define "binx.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: worker
{{- end -}}

{{- define "binx.labels" -}}
{{ include "binx.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "binx.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "binx.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the cluster's shared secret: the given one, or the
     one the chart generates (templates/secret.yaml). */}}
{{- define "binx.sharedSecretName" -}}
{{- default (printf "%s-shared-secret" (include "binx.fullname" .)) .Values.binxd.sharedSecret.existingSecret -}}
{{- end -}}

{{/* Where binxd's admin socket lives: a directory only binxd mounts, so the
     engine container cannot reach the admin service. */}}
{{- define "binx.adminSocket" -}}
/var/run/binx-admin/binx-admin.sock
{{- end -}}

{{/* binxd's configuration file: the chart's keys, then binxd.config over them. */}}
{{- define "binx.binxdConfig" -}}
{{- $v := .Values.binxd -}}
{{- $base := dict
  "tcp_listen" (printf "0.0.0.0:%d" (int $v.ports.binx))
  "http_listen" (printf "0.0.0.0:%d" (int $v.ports.http))
  "uds_path" "/var/run/binx/binx.sock"
  "admin_uds_path" (include "binx.adminSocket" .)
  "data_dir" "/var/lib/binx/data"
  "memory_limit" $v.memoryLimit
  "task_memory_limit" $v.taskMemoryLimit
  "drain_grace" $v.drainGrace
  "default_spool_policy" $v.spool.defaultPolicy
  "spool_stores" $v.spool.stores
  "spool_codec" $v.spool.codec
  "spool_encryption" $v.spool.encryption
  "spool_ttl" $v.spool.ttl
  "forward_allowed_peers" $v.forwardAllowedPeers
-}}
{{- if $v.spool.s3.endpoint }}{{ $_ := set $base "spool_s3_endpoint" $v.spool.s3.endpoint }}{{ end -}}
{{- if $v.spool.s3.region }}{{ $_ := set $base "spool_s3_region" $v.spool.s3.region }}{{ end -}}
{{- if $v.logFormat }}{{ $_ := set $base "log_format" $v.logFormat }}{{ end -}}
{{- if $v.tls.existingSecret -}}
{{- $_ := set $base "tls_cert" "/etc/binx/tls/tls.crt" -}}
{{- $_ := set $base "tls_key" "/etc/binx/tls/tls.key" -}}
{{- $_ := set $base "tls_ca" "/etc/binx/tls/ca.crt" -}}
{{- $_ := set $base "tls_client_auth" $v.tls.clientAuth -}}
{{- end -}}
{{- toToml (mergeOverwrite $base $v.config) -}}
{{- end -}}

{{/* The binxd container (a native sidecar or a plain container). */}}
{{- define "binx.binxdContainer" -}}
{{- $v := .Values.binxd -}}
- name: binxd
  image: {{ printf "%s:%s" $v.image.repository (default .Chart.AppVersion $v.image.tag) | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- if $v.nativeSidecar }}
  restartPolicy: Always
  {{- end }}
  args: ["--config", "/etc/binx/binxd.toml"]
  ports:
    - name: binx
      containerPort: {{ $v.ports.binx }}
      protocol: TCP
    - name: http
      containerPort: {{ $v.ports.http }}
      protocol: TCP
  env:
    - name: POD_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    - name: BINX_NAME
      value: "$(POD_NAME)"
    - name: BINX_SPOOL_NODE_NAME
      value: "$(POD_NAME)"
    # `binx stats`, `binx tasks` ... in this container find the admin socket.
    - name: BINX_ADMIN
      value: {{ include "binx.adminSocket" . | quote }}
    - name: BINX_SHARED_SECRET
      valueFrom:
        secretKeyRef:
          name: {{ include "binx.sharedSecretName" . }}
          key: {{ $v.sharedSecret.key }}
    {{- if $v.spool.s3.credentialsSecret }}
    - name: BINX_SPOOL_S3_ACCESS_KEY_ID
      valueFrom:
        secretKeyRef:
          name: {{ $v.spool.s3.credentialsSecret }}
          key: {{ $v.spool.s3.accessKeyIdKey }}
    - name: BINX_SPOOL_S3_SECRET_ACCESS_KEY
      valueFrom:
        secretKeyRef:
          name: {{ $v.spool.s3.credentialsSecret }}
          key: {{ $v.spool.s3.secretAccessKeyKey }}
    {{- end }}
    {{- with $v.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $v.envFrom }}
  envFrom:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  readinessProbe:
    httpGet:
      path: /readyz
      port: http
    periodSeconds: {{ $v.probes.readiness.periodSeconds }}
    failureThreshold: {{ $v.probes.readiness.failureThreshold }}
  livenessProbe:
    httpGet:
      path: /healthz
      port: http
    periodSeconds: {{ $v.probes.liveness.periodSeconds }}
    failureThreshold: {{ $v.probes.liveness.failureThreshold }}
  startupProbe:
    httpGet:
      path: /healthz
      port: http
    periodSeconds: 1
    failureThreshold: 60
  lifecycle:
    preStop:
      exec:
        # Readiness goes false and held pages are served to consumers; the
        # kubelet's SIGTERM that follows does not cut the drain short.
        command: ["binx", "drain", "--admin", {{ include "binx.adminSocket" . | quote }}]
  resources:
    {{- toYaml $v.resources | nindent 4 }}
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  volumeMounts:
    - name: binx-socket
      mountPath: /var/run/binx
    - name: binx-admin
      mountPath: {{ include "binx.adminSocket" . | dir }}
    - name: binx-data
      mountPath: /var/lib/binx
    - name: binx-config
      mountPath: /etc/binx
      readOnly: true
    {{- if $v.tls.existingSecret }}
    - name: binx-tls
      mountPath: /etc/binx/tls
      readOnly: true
    {{- end }}
    {{- if .Values.sharedMemory.enabled }}
    - name: binx-shm
      mountPath: /dev/shm
    {{- end }}
{{- end -}}

{{/* The ConfigMap key of an engine file: its base name (readable in
     kubectl) and a hash of its whole path (two files may share a name). */}}
{{- define "binx.engineFileKey" -}}
{{- printf "%s-%s" (regexReplaceAll "[^-._a-zA-Z0-9]" (base .) "_" | trunc 200) (sha256sum . | trunc 10) -}}
{{- end -}}
