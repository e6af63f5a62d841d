//! The Helm chart, rendered by real helm (installed by
//! scripts/ensure-helm.sh when missing): the pod has binxd beside the
//! engine, native sidecar or plain container, sharing the socket volume;
//! and the rendered binxd.toml, run by a real binxd, serves the endpoints
//! the probes name, and the preStop command drains it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_yaml::Value;

use crate::common::{TempDir, binary, http_get};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn helm() -> PathBuf {
    let out = Command::new(repo().join("scripts/ensure-helm.sh"))
        .stderr(Stdio::inherit())
        .output()
        .expect("scripts/ensure-helm.sh runs");
    assert!(
        out.status.success(),
        "no helm, and it could not be installed"
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// Every document `helm template` prints for `args`.
fn render(args: &[&str]) -> Vec<Value> {
    let out = Command::new(helm())
        .args(["template", "binx"])
        .arg(repo().join("deploy/helm/binx"))
        .args(["--kube-version", "1.31.0"])
        .args(args)
        .output()
        .expect("helm runs");
    assert!(
        out.status.success(),
        "helm template {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf-8");
    text.split("\n---")
        .filter_map(|doc| serde_yaml::from_str::<Value>(doc).ok())
        .filter(|doc| doc.get("kind").is_some())
        .collect()
}

fn of_kind<'a>(docs: &'a [Value], kinds: &[&str]) -> &'a Value {
    docs.iter()
        .find(|d| kinds.contains(&d["kind"].as_str().unwrap_or("")))
        .unwrap_or_else(|| panic!("no {kinds:?} rendered"))
}

fn named<'a>(list: &'a Value, name: &str) -> Option<&'a Value> {
    list.as_sequence()?
        .iter()
        .find(|item| item["name"].as_str() == Some(name))
}

fn mount_path<'a>(container: &'a Value, volume: &str) -> Option<&'a str> {
    named(&container["volumeMounts"], volume)?["mountPath"].as_str()
}

/// What the pod must have, whichever way binxd runs in it.
struct Pod<'a> {
    spec: &'a Value,
    binxd: &'a Value,
    engine: &'a Value,
}

/// The one container besides binxd (named by `engine.name`).
fn engine_container(spec: &Value) -> &Value {
    let others: Vec<&Value> = spec["containers"]
        .as_sequence()
        .expect("containers")
        .iter()
        .filter(|c| c["name"].as_str() != Some("binxd"))
        .collect();
    assert_eq!(others.len(), 1, "one engine container: {others:?}");
    others[0]
}

fn pod(docs: &[Value], native_sidecar: bool) -> Pod<'_> {
    let workload = of_kind(docs, &["StatefulSet", "Deployment"]);
    let spec = &workload["spec"]["template"]["spec"];
    let (binxd, engine) = if native_sidecar {
        let binxd = named(&spec["initContainers"], "binxd").expect("binxd is an init container");
        assert_eq!(
            binxd["restartPolicy"].as_str(),
            Some("Always"),
            "a native sidecar is an init container that restarts always"
        );
        assert!(named(&spec["containers"], "binxd").is_none());
        (binxd, engine_container(spec))
    } else {
        assert!(
            spec["initContainers"].is_null(),
            "{:?}",
            spec["initContainers"]
        );
        let binxd = named(&spec["containers"], "binxd").expect("binxd is a container");
        assert!(binxd.get("restartPolicy").is_none());
        (binxd, engine_container(spec))
    };
    Pod {
        spec,
        binxd,
        engine,
    }
}

fn check_pod_shape(pod: &Pod<'_>, config: &toml_like::Config) {
    // One socket volume, an emptyDir, at /var/run/binx in both containers,
    // where binxd's configuration puts its socket and the engine looks.
    let socket = named(&pod.spec["volumes"], "binx-socket").expect("socket volume");
    assert!(socket.get("emptyDir").is_some(), "{socket:?}");
    assert_eq!(mount_path(pod.binxd, "binx-socket"), Some("/var/run/binx"));
    assert_eq!(mount_path(pod.engine, "binx-socket"), Some("/var/run/binx"));
    assert_eq!(config.get("uds_path"), "/var/run/binx/binx.sock");
    let engine_env = named(&pod.engine["env"], "BINX_UDS_PATH").expect("engine knows the socket");
    assert_eq!(engine_env["value"].as_str(), Some(config.get("uds_path")));
    // binxd reads the ConfigMap it is given.
    let args: Vec<&str> = pod.binxd["args"]
        .as_sequence()
        .expect("binxd args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(args, ["--config", "/etc/binx/binxd.toml"]);
    assert_eq!(mount_path(pod.binxd, "binx-config"), Some("/etc/binx"));
    // Forwarding reaches pod networks only: never link-local metadata
    // endpoints or public addresses (docs/SECURITY.md).
    let peers: binx_core::PeerAllowList = config
        .get("forward_allowed_peers")
        .parse()
        .expect("forward_allowed_peers parses");
    assert!(peers.allows("10.1.2.3:8091"), "{peers}");
    for outside in [
        "169.254.169.254:80",
        "8.8.8.8:53",
        "metadata.google.internal:80",
    ] {
        assert!(!peers.allows(outside), "{outside} allowed by {peers}");
    }
    // Hardening.
    let security = &pod.binxd["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"].as_bool(), Some(true));
    assert_eq!(security["allowPrivilegeEscalation"].as_bool(), Some(false));
    assert_eq!(security["capabilities"]["drop"][0].as_str(), Some("ALL"));
    assert_eq!(
        pod.spec["securityContext"]["runAsNonRoot"].as_bool(),
        Some(true)
    );
    // Where binxd writes, it has a volume (the root filesystem is read-only).
    assert!(
        config
            .get("data_dir")
            .starts_with(mount_path(pod.binxd, "binx-data").expect("data volume")),
        "data_dir {} is not on the data volume",
        config.get("data_dir")
    );
}

/// The named container port a probe's `port` refers to.
fn probe_port(binxd: &Value, probe: &Value) -> u64 {
    let port = &probe["httpGet"]["port"];
    match port.as_str() {
        Some(name) => named(&binxd["ports"], name)
            .unwrap_or_else(|| panic!("the probe names port {name}, which binxd does not declare"))
            ["containerPort"]
            .as_u64()
            .expect("containerPort"),
        None => port.as_u64().expect("a port number"),
    }
}

/// Just enough of TOML for `key = "string"` lines, which is all the chart
/// writes (checked: any other line fails the test).
mod toml_like {
    pub(super) struct Config(pub Vec<(String, String)>);

    impl Config {
        pub(super) fn parse(text: &str) -> Config {
            Config(
                text.lines()
                    .filter(|l| !l.trim().is_empty())
                    .map(|line| {
                        let (key, value) = line
                            .split_once(" = ")
                            .unwrap_or_else(|| panic!("not a key = value line: {line}"));
                        let value = value
                            .strip_prefix('"')
                            .and_then(|v| v.strip_suffix('"'))
                            .unwrap_or(value);
                        (key.to_string(), value.to_string())
                    })
                    .collect(),
            )
        }

        pub(super) fn get(&self, key: &str) -> &str {
            self.0
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
                .unwrap_or_else(|| panic!("binxd.toml has no {key}"))
        }
    }
}

fn rendered_config(docs: &[Value]) -> String {
    docs.iter()
        .filter(|d| d["kind"].as_str() == Some("ConfigMap"))
        .find_map(|d| d["data"]["binxd.toml"].as_str())
        .expect("binxd.toml in a ConfigMap")
        .to_string()
}

/// Writes a rendered binxd.toml into `dir` and checks that binxd accepts
/// it as it is (`binxd --config FILE --print-config`).
fn write_accepted_config(text: &str, dir: &Path, rendered_from: &str) -> PathBuf {
    let file = dir.join("binxd.toml");
    std::fs::write(&file, text).unwrap();
    let check = Command::new(binary("binxd"))
        .arg("--config")
        .arg(&file)
        .arg("--print-config")
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "binxd refuses the binxd.toml rendered from {rendered_from}: {}",
        String::from_utf8_lossy(&check.stderr)
    );
    file
}

/// Runs binxd with the chart's binxd.toml as it is, except that the pod's
/// paths move into `dir` and the ports to free ones on loopback (flags
/// override the file, as the chart's environment variables do).
fn run_rendered(config_text: &str, dir: &Path) -> (std::process::Child, String, PathBuf) {
    let file = write_accepted_config(config_text, dir, "the defaults");
    let admin = dir.join("binx-admin.sock");
    let ready = dir.join("ready");
    let mut child = Command::new(binary("binxd"))
        .arg("--config")
        .arg(&file)
        .args([
            "--tcp-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .arg("--ready-file")
        .arg(&ready)
        .arg("--uds-path")
        .arg(dir.join("binx.sock"))
        .arg("--admin-uds-path")
        .arg(&admin)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(["--spool-stores", "auto", "--spool-node-name", "chart-test"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("binxd.log")).unwrap())
        .spawn()
        .expect("binxd starts");
    wait_until(
        "binxd writes its ready file",
        Duration::from_secs(20),
        || ready.exists() || !matches!(child.try_wait(), Ok(None)),
    );
    let bound = std::fs::read_to_string(&ready).unwrap_or_else(|_| {
        panic!(
            "binxd stopped: {}",
            std::fs::read_to_string(dir.join("binxd.log")).unwrap_or_default()
        )
    });
    let http = bound
        .lines()
        .find_map(|l| l.strip_prefix("http="))
        .expect("http in the ready file")
        .to_string();
    (child, http, admin)
}

fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what} within {limit:?}");
}

fn probes_hit_real_endpoints_and_prestop_drains(pod: &Pod<'_>, config_text: &str) {
    let config = toml_like::Config::parse(config_text);
    let dir = TempDir::new("chart");
    let (mut child, http, admin) = run_rendered(config_text, &dir.0);
    let http_port_in_pod: u64 = config
        .get("http_listen")
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("http_listen has a port");
    let mut probed = Vec::new();
    for kind in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let probe = &pod.binxd[kind];
        assert!(!probe.is_null(), "binxd has no {kind}");
        assert_eq!(
            probe_port(pod.binxd, probe),
            http_port_in_pod,
            "{kind} probes a port binxd's http_listen does not serve"
        );
        let path = probe["httpGet"]["path"].as_str().expect("probe path");
        wait_until(
            &format!("{kind} {path} answers 200"),
            Duration::from_secs(20),
            || std::net::TcpStream::connect(&http).is_ok() && http_get(&http, path).0 == 200,
        );
        probed.push(path.to_string());
    }
    // The pod's Service and NetworkPolicy name the same ports.
    let binx_port = named(&pod.binxd["ports"], "binx").expect("binx port")["containerPort"]
        .as_u64()
        .unwrap();
    assert!(config.get("tcp_listen").ends_with(&format!(":{binx_port}")));

    // preStop, as the kubelet runs it (its socket path moved with the rest).
    let command: Vec<String> = pod.binxd["lifecycle"]["preStop"]["exec"]["command"]
        .as_sequence()
        .expect("a preStop exec hook")
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    assert_eq!(command[0], "binx");
    assert_eq!(
        command
            .iter()
            .skip_while(|a| *a != "--admin")
            .nth(1)
            .map(String::as_str),
        Some(config.get("admin_uds_path")),
        "preStop talks to the admin socket binxd.toml configures"
    );
    let args: Vec<String> = command[1..]
        .iter()
        .map(|a| {
            if a == config.get("admin_uds_path") {
                admin.display().to_string()
            } else {
                a.clone()
            }
        })
        .collect();
    let out = Command::new(binary("binx")).args(&args).output().unwrap();
    assert!(
        out.status.success(),
        "preStop {command:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Nothing is held, so the drain ends binxd; readiness went false first.
    let status = {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "binxd did not stop after preStop"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    assert!(status.success(), "{status:?}");
    let log = std::fs::read_to_string(dir.0.join("binxd.log")).unwrap_or_default();
    assert!(log.contains("admin StartDrain received"), "{log}");
    assert_eq!(probed.len(), 3);
}

#[test]
fn native_sidecar_pod_serves_its_probes_and_drains_on_prestop() {
    let docs = render(&[]);
    let pod = pod(&docs, true);
    let text = rendered_config(&docs);
    check_pod_shape(&pod, &toml_like::Config::parse(&text));
    probes_hit_real_endpoints_and_prestop_drains(&pod, &text);
    // The headless Service exposes both named ports.
    let service = of_kind(&docs, &["Service"]);
    assert_eq!(service["spec"]["clusterIP"].as_str(), Some("None"));
    for port in ["binx", "http"] {
        assert!(named(&service["spec"]["ports"], port).is_some(), "{port}");
    }
    // The grace period outlasts binxd's drain.
    let grace = pod.spec["terminationGracePeriodSeconds"].as_u64().unwrap();
    let drain = toml_like::Config::parse(&text)
        .get("drain_grace")
        .trim_end_matches('s')
        .parse::<u64>()
        .unwrap();
    assert!(grace > drain, "grace {grace}s <= drain_grace {drain}s");
}

#[test]
fn every_example_renders_a_pod_binxd_accepts() {
    let examples = repo().join("deploy/helm/binx/examples");
    let mut names: Vec<PathBuf> = std::fs::read_dir(&examples)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    assert!(names.len() >= 4, "S3, GCS, Azure and local examples");
    for values in names {
        let docs = render(&["-f", values.to_str().unwrap()]);
        let text = rendered_config(&docs);
        let native = of_kind(&docs, &["StatefulSet", "Deployment"])["spec"]["template"]["spec"]
            ["initContainers"]
            .is_sequence();
        let pod = pod(&docs, native);
        check_pod_shape(&pod, &toml_like::Config::parse(&text));
        let dir = TempDir::new("chart-example");
        write_accepted_config(&text, &dir.0, &values.display().to_string());
    }
}

#[test]
fn plain_container_pod_serves_its_probes_and_drains_on_prestop() {
    let docs = render(&[
        "--set",
        "binxd.nativeSidecar=false",
        "--set",
        "sharedMemory.enabled=true",
    ]);
    let pod = pod(&docs, false);
    let text = rendered_config(&docs);
    check_pod_shape(&pod, &toml_like::Config::parse(&text));
    // Shared memory: a memory-backed emptyDir in both containers.
    let shm = named(&pod.spec["volumes"], "binx-shm").expect("shm volume");
    assert_eq!(shm["emptyDir"]["medium"].as_str(), Some("Memory"));
    assert_eq!(mount_path(pod.binxd, "binx-shm"), Some("/dev/shm"));
    assert_eq!(mount_path(pod.engine, "binx-shm"), Some("/dev/shm"));
    probes_hit_real_endpoints_and_prestop_drains(&pod, &text);
}

#[test]
fn a_tls_secret_is_mounted_where_binxd_toml_looks_for_it() {
    let docs = render(&[
        "--set",
        "binxd.tls.existingSecret=binx-tls",
        "--set",
        "binxd.tls.clientAuth=true",
    ]);
    let tls_pod = pod(&docs, true);
    let config = toml_like::Config::parse(&rendered_config(&docs));
    let volume = named(&tls_pod.spec["volumes"], "binx-tls").expect("TLS volume");
    assert_eq!(volume["secret"]["secretName"].as_str(), Some("binx-tls"));
    let dir = mount_path(tls_pod.binxd, "binx-tls").expect("TLS mount");
    for (key, file) in [
        ("tls_cert", "tls.crt"),
        ("tls_key", "tls.key"),
        ("tls_ca", "ca.crt"),
    ] {
        assert_eq!(config.get(key), format!("{dir}/{file}"), "{key}");
    }
    assert_eq!(config.get("tls_client_auth"), "true");
    // Without the value, binxd.toml has no TLS key and nothing is mounted.
    let plain = render(&[]);
    assert!(!rendered_config(&plain).contains("tls_"));
    assert!(mount_path(pod(&plain, true).binxd, "binx-tls").is_none());
}

/// The Secret an environment variable of `container` is read from: (name, key).
fn secret_ref<'a>(container: &'a Value, variable: &str) -> (&'a str, &'a str) {
    let env = named(&container["env"], variable).unwrap_or_else(|| {
        panic!(
            "no {variable} in {}",
            container["name"].as_str().unwrap_or("?")
        )
    });
    let reference = &env["valueFrom"]["secretKeyRef"];
    (
        reference["name"].as_str().expect("a Secret name"),
        reference["key"].as_str().expect("a Secret key"),
    )
}

fn base64_decode(text: &str) -> String {
    let mut child = Command::new("base64")
        .arg("-d")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("base64 (coreutils) runs");
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{text:?} is not base64");
    String::from_utf8(out.stdout).expect("a UTF-8 secret")
}

/// Closed by default (docs/SECURITY.md): a shared secret is always set and
/// both binxd and the engine get it; a NetworkPolicy admits only engine pods
/// to binxd's ports; the admin socket is in a directory the engine does not
/// mount. And binxd, run with the rendered config and secret, refuses an
/// exchange request without the engines' JWT.
#[test]
fn the_chart_is_closed_by_default() {
    let docs = render(&[]);
    let pod = pod(&docs, true);
    let text = rendered_config(&docs);
    let config = toml_like::Config::parse(&text);

    // A generated secret, read by both containers.
    let secrets: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "Secret").collect();
    assert_eq!(secrets.len(), 1, "one generated Secret");
    let name = secrets[0]["metadata"]["name"].as_str().unwrap();
    let (binxd_secret, key) = secret_ref(pod.binxd, "BINX_SHARED_SECRET");
    assert_eq!((binxd_secret, key), (name, "shared-secret"));
    assert_eq!(
        secret_ref(pod.engine, "INTERNAL_COMMUNICATION_SHARED_SECRET"),
        (name, key)
    );
    let secret = base64_decode(secrets[0]["data"][key].as_str().expect("secret data"));
    assert_eq!(secret.len(), 48, "{secret:?}");
    assert!(secret.chars().all(|c| c.is_ascii_alphanumeric()));
    // Random per install (helm template sees no cluster, so no old value).
    let again = render(&[]);
    let other = again.iter().find(|d| d["kind"] == "Secret").unwrap();
    assert_ne!(other["data"][key], secrets[0]["data"][key]);
    // An existing Secret: nothing generated, both containers read it.
    let given = render(&[
        "--set",
        "binxd.sharedSecret.existingSecret=cluster-secret",
        "--set",
        "binxd.sharedSecret.key=token",
    ]);
    assert!(!given.iter().any(|d| d["kind"] == "Secret"));
    let given_pod = self::pod(&given, true);
    assert_eq!(
        secret_ref(given_pod.binxd, "BINX_SHARED_SECRET"),
        ("cluster-secret", "token")
    );
    assert_eq!(
        secret_ref(given_pod.engine, "INTERNAL_COMMUNICATION_SHARED_SECRET"),
        ("cluster-secret", "token")
    );

    // The NetworkPolicy: binxd's ports only from the release's worker pods;
    // every other port (the engine's own) from anywhere.
    let policy = of_kind(&docs, &["NetworkPolicy"]);
    let workers =
        &of_kind(&docs, &["StatefulSet", "Deployment"])["spec"]["selector"]["matchLabels"];
    assert_eq!(&policy["spec"]["podSelector"]["matchLabels"], workers);
    let port_of = |name: &str| {
        named(&pod.binxd["ports"], name).expect("port")["containerPort"]
            .as_u64()
            .unwrap()
    };
    let binxd_ports = [port_of("binx"), port_of("http")];
    let admitted = |port: u64, peer: Option<&Value>| admits(policy, port, peer);
    for port in binxd_ports {
        assert!(admitted(port, Some(workers)), "workers reach {port}");
        assert!(!admitted(port, None), "anyone reaches {port}");
        let stranger: Value = serde_yaml::from_str("{app: stranger}").unwrap();
        assert!(!admitted(port, Some(&stranger)), "{port}");
    }
    let (lo, hi) = (
        binxd_ports[0].min(binxd_ports[1]),
        binxd_ports[0].max(binxd_ports[1]),
    );
    for engine_port in [1, 80, 8080, lo - 1, hi + 1, 65535] {
        assert!(
            admitted(engine_port, None),
            "the engine's port {engine_port} is closed"
        );
    }

    // The admin socket: in a directory only binxd mounts.
    let admin = Path::new(config.get("admin_uds_path"));
    let admin_dir = admin.parent().unwrap().to_str().unwrap();
    let volume = pod.binxd["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"].as_str() == Some(admin_dir))
        .and_then(|m| m["name"].as_str())
        .expect("the admin socket's directory is a volume of binxd's");
    assert!(
        mount_path(pod.engine, volume).is_none(),
        "the engine mounts {volume}"
    );
    for mount in pod.engine["volumeMounts"].as_sequence().unwrap() {
        let path = mount["mountPath"].as_str().unwrap();
        assert!(
            !admin.starts_with(path),
            "the engine reaches {admin:?} under {path}"
        );
    }

    // binxd with this config and secret: the exchange needs the JWT.
    let dir = TempDir::new("chart-closed");
    let file = write_accepted_config(&text, &dir.0, "the defaults");
    let daemon = crate::common::Daemon::start_with_env(
        &[
            "--config",
            file.to_str().unwrap(),
            "--data-dir",
            dir.0.join("data").to_str().unwrap(),
            "--admin-uds-path",
            dir.0.join("admin.sock").to_str().unwrap(),
            "--spool-node-name",
            "chart-closed",
        ],
        &[("BINX_SHARED_SECRET".to_string(), secret.clone())],
    );
    let path = "/v1/task/q1.0.0.0/results/0/0";
    let wait = [("X-Presto-Max-Wait", "10ms")];
    let refused = crate::common::http_request(&daemon.http, "GET", path, &wait);
    assert_eq!(refused.status, 401);
    let bearer = crate::common::presto_bearer(&secret);
    let signed = crate::common::http_request(
        &daemon.http,
        "GET",
        path,
        &[wait[0], ("X-Presto-Internal-Bearer", bearer.as_str())],
    );
    assert_eq!(signed.status, 204);
}

/// Whether `policy` admits TCP to `port` from a pod with `labels` (None:
/// a pod it names in no rule).
fn admits(policy: &Value, port: u64, labels: Option<&Value>) -> bool {
    policy["spec"]["ingress"]
        .as_sequence()
        .expect("ingress rules")
        .iter()
        .any(|rule| {
            let peer_ok = match rule["from"].as_sequence() {
                None => true,
                Some(peers) => peers.iter().any(|peer| {
                    labels.is_some_and(|l| &peer["podSelector"]["matchLabels"] == l)
                        && peer.get("namespaceSelector").is_none()
                }),
            };
            let port_ok = rule["ports"].as_sequence().is_some_and(|ports| {
                ports.iter().any(|p| {
                    let from = p["port"].as_u64().unwrap_or(0);
                    let to = p["endPort"].as_u64().unwrap_or(from);
                    p["protocol"].as_str() == Some("TCP") && (from..=to).contains(&port)
                })
            });
            peer_ok && port_ok
        })
}

/// Engine peers named in networkPolicy.engineFrom (the coordinator) reach
/// binxd's ports too; with binxd on the edge ports, the engine's ranges
/// still leave them out.
#[test]
fn the_network_policy_admits_the_engine_peers_it_is_given() {
    let docs = render(&[
        "--set-json",
        r#"networkPolicy.engineFrom=[{"podSelector":{"matchLabels":{"app":"trino"}}}]"#,
        "--set",
        "binxd.ports.binx=1",
        "--set",
        "binxd.ports.http=65535",
    ]);
    let policy = of_kind(&docs, &["NetworkPolicy"]);
    let coordinator: Value = serde_yaml::from_str("{app: trino}").unwrap();
    for port in [1, 65535] {
        assert!(admits(policy, port, Some(&coordinator)), "{port}");
        assert!(!admits(policy, port, None), "{port}");
    }
    assert!(admits(policy, 2, None) && admits(policy, 65534, None));
}

/// A `key=value` properties file (Trino's), as a list of pairs.
fn properties(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l
                .split_once('=')
                .unwrap_or_else(|| panic!("not key=value: {l}"));
            (k.trim().to_string(), v.trim().to_string())
        })
        .collect()
}

fn property<'a>(props: &'a [(String, String)], key: &str) -> Option<&'a str> {
    props
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// The Trino examples (fault-tolerant execution on binx): each file given
/// in `engine.files` is in the engine-files ConfigMap, byte for byte, and
/// mounted at its path in the engine container; the exchange manager is
/// binx on the very socket the sidecar listens at; coordinator and workers
/// share the secret and the spool store (failover reads another pod's
/// committed output), and the workers admit the coordinator's sidecar.
#[test]
fn the_trino_examples_give_trino_the_binx_exchange_manager_on_the_sidecar_socket() {
    let examples = repo().join("deploy/helm/binx/examples");
    let mut stores = Vec::new();
    let mut secrets = Vec::new();
    for (release, file) in [
        ("trino-coordinator", "trino-fte-coordinator.yaml"),
        ("trino-workers", "trino-fte-workers.yaml"),
    ] {
        let values_path = examples.join(file);
        let values: Value =
            serde_yaml::from_str(&std::fs::read_to_string(&values_path).unwrap()).unwrap();
        let out = Command::new(helm())
            .args(["template", release])
            .arg(repo().join("deploy/helm/binx"))
            .args(["--kube-version", "1.31.0", "-f"])
            .arg(&values_path)
            .output()
            .expect("helm runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let docs: Vec<Value> = text
            .split("\n---")
            .filter_map(|doc| serde_yaml::from_str::<Value>(doc).ok())
            .filter(|doc| doc.get("kind").is_some())
            .collect();
        let config = toml_like::Config::parse(&rendered_config(&docs));
        let pod = pod(&docs, true);
        let files_map = docs
            .iter()
            .find(|d| {
                d["kind"].as_str() == Some("ConfigMap")
                    && d["metadata"]["name"].as_str()
                        == Some(&format!("{release}-binx-engine-files"))
            })
            .unwrap_or_else(|| panic!("{file}: no engine-files ConfigMap"));
        let volume = named(&pod.spec["volumes"], "engine-files").expect("engine-files volume");
        assert_eq!(volume["configMap"]["name"], files_map["metadata"]["name"]);
        let wanted = values["engine"]["files"]
            .as_mapping()
            .expect("engine.files");
        assert!(
            wanted.len() >= 2,
            "{file}: config.properties and exchange-manager.properties"
        );
        let mut seen = std::collections::BTreeMap::new();
        for (path, content) in wanted {
            let path = path.as_str().unwrap();
            let mount = pod.engine["volumeMounts"]
                .as_sequence()
                .unwrap()
                .iter()
                .find(|m| m["mountPath"].as_str() == Some(path))
                .unwrap_or_else(|| panic!("{file}: nothing mounted at {path}"));
            assert_eq!(mount["name"].as_str(), Some("engine-files"));
            assert_eq!(mount["readOnly"].as_bool(), Some(true));
            let key = mount["subPath"].as_str().expect("subPath");
            assert_eq!(
                files_map["data"][key].as_str(),
                content.as_str(),
                "{file}: {path} in the ConfigMap under {key}"
            );
            seen.insert(path.to_string(), properties(content.as_str().unwrap()));
        }
        let manager = &seen["/etc/trino/exchange-manager.properties"];
        assert_eq!(property(manager, "exchange-manager.name"), Some("binx"));
        assert_eq!(
            property(manager, "exchange.binx.socket"),
            Some(config.get("uds_path")),
            "{file}: the plugin's socket is the sidecar's"
        );
        let engine_config = &seen["/etc/trino/config.properties"];
        assert_eq!(property(engine_config, "retry-policy"), Some("TASK"));
        assert_eq!(
            property(engine_config, "internal-communication.shared-secret"),
            Some("${ENV:INTERNAL_COMMUNICATION_SHARED_SECRET}")
        );
        let (secret, _) = secret_ref(pod.engine, "INTERNAL_COMMUNICATION_SHARED_SECRET");
        secrets.push(secret.to_string());
        // Committed output must outlive the pod: a store every pod shares.
        let store = config.get("spool_stores").to_string();
        assert!(store.starts_with("s3://"), "{file}: {store}");
        stores.push(store);
        assert_eq!(config.get("default_spool_policy"), "commit");
        let dir = TempDir::new("chart-trino");
        write_accepted_config(&rendered_config(&docs), &dir.0, file);
        if release == "trino-workers" {
            let policy = of_kind(&docs, &["NetworkPolicy"]);
            let coordinator =
                serde_yaml::from_str::<Value>("{app.kubernetes.io/instance: trino-coordinator}")
                    .unwrap();
            let port: u64 = config
                .get("tcp_listen")
                .rsplit(':')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            assert!(
                admits(policy, port, Some(&coordinator)),
                "the workers' sidecars admit the coordinator's"
            );
        }
    }
    assert_eq!(stores[0], stores[1], "one spool store for the cluster");
    assert_eq!(secrets[0], secrets[1], "one shared secret for the cluster");
}
