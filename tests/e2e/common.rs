//! Real binxd processes for the end-to-end tests: free ports, a private
//! directory for the socket, readiness, stats over HTTP, clean-up on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use binx_client::{Connection, ConnectionOptions, Endpoint};

/// Path of one of the package's binaries, which cargo builds before it
/// builds the tests.
pub(crate) fn binary(name: &str) -> PathBuf {
    match name {
        "binxd" => PathBuf::from(env!("CARGO_BIN_EXE_binxd")),
        "binx" => PathBuf::from(env!("CARGO_BIN_EXE_binx")),
        other => panic!("the package has no binary {other}"),
    }
}

/// Starts an emulator that must know its port before it starts (its own
/// URLs carry it), without reserving the port by bind-and-release. Ports
/// are drawn below the kernel's ephemeral range (which starts at 32768),
/// where binxd's port 0 and every client socket land, so only another
/// emulator of the run can hold one; then `spawn`'s process fails to bind
/// and exits, and the next port is tried. The port counts as ours only when
/// the listening socket on it belongs to the child (/proc), never merely
/// because something answers there.
pub(crate) fn spawn_on_port(what: &str, mut spawn: impl FnMut(u16) -> Child) -> (Child, u16) {
    for _ in 0..20 {
        // 26000-31999: below the ephemeral range, apart from the S3 server's.
        let port = fastrand::u16(26_000..32_000);
        let mut child = spawn(port);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if listens_on(child.id(), port) {
                return (child, port);
            }
            if matches!(child.try_wait(), Ok(Some(_))) || Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    panic!("{what} did not start on any of 20 ports");
}

/// Whether process `pid` holds a socket listening on TCP `port`.
fn listens_on(pid: u32, port: u16) -> bool {
    let wanted = format!(":{port:04X}");
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local_address is field 1, st (0A = LISTEN) field 3, inode field 9.
            if fields.len() > 9 && fields[1].ends_with(&wanted) && fields[3] == "0A" {
                inodes.push(format!("socket:[{}]", fields[9]));
            }
        }
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .is_ok_and(|target| inodes.iter().any(|i| target.as_os_str() == i.as_str()))
    })
}

/// Records that `test` could not run here and why: on stderr, and as a
/// line in target/skipped-tests, which .ci/run prints after the tests as
/// skipped, never passed.
pub(crate) fn skipped(test: &str, why: &str) {
    eprintln!("SKIPPED: {test}: {why}");
    let marker = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/skipped-tests");
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(marker)
    {
        use std::io::Write;
        let _ = writeln!(file, "{test}: {why}");
    }
}

/// A directory of its own for one test, removed on drop.
pub(crate) struct TempDir(pub PathBuf);

impl TempDir {
    pub(crate) fn new(label: &str) -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("binx-{label}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("temp dir");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One running binxd.
pub(crate) struct Daemon {
    pub child: Child,
    pub tcp: String,
    pub http: String,
    pub uds: PathBuf,
    pub dir: TempDir,
    /// The `--shared-secret` it was started with: /v1/stats then needs a
    /// bearer token signed with it.
    pub secret: Option<String>,
}

impl Daemon {
    /// Starts binxd with free ports, its socket in a private directory, and
    /// `extra` flags; waits until it serves.
    pub(crate) fn start(extra: &[&str]) -> Daemon {
        Daemon::start_with_env(extra, &[])
    }

    /// Like [`Daemon::start`], with extra environment variables.
    pub(crate) fn start_with_env(extra: &[&str], env: &[(String, String)]) -> Daemon {
        Daemon::launch(&[], None, None, extra, env)
    }

    /// Like [`Daemon::start_with_env`], listening for BinX on `tcp` (to
    /// stand for a pod that restarts at the same address).
    pub(crate) fn start_on(tcp: &str, extra: &[&str], env: &[(String, String)]) -> Daemon {
        Daemon::launch(&[], Some(tcp), None, extra, env)
    }

    /// A binxd on the ports of `before`, which must have stopped: a pod
    /// restarted at the same address, as its consumers see it.
    pub(crate) fn restart_of(before: &Daemon, extra: &[&str]) -> Daemon {
        Daemon::launch(&[], Some(&before.tcp), Some(&before.http), extra, &[])
    }

    /// Like [`Daemon::start`], run through `launcher` (e.g. `prlimit
    /// --nofile=400:400`), which must exec binxd with the arguments after it.
    pub(crate) fn start_launched(launcher: &[&str], extra: &[&str]) -> Daemon {
        Daemon::launch(launcher, None, None, extra, &[])
    }

    /// Starts binxd on the given addresses, or on ports the system picks
    /// (port 0), whose numbers binxd writes to its `--ready-file`: no port
    /// is reserved and released first, which another test could take.
    fn launch(
        launcher: &[&str],
        tcp: Option<&str>,
        http: Option<&str>,
        extra: &[&str],
        env: &[(String, String)],
    ) -> Daemon {
        let dir = TempDir::new("daemon");
        let uds = dir.0.join("binx.sock");
        let ready = dir.0.join("ready");
        let log = std::fs::File::create(dir.0.join("binxd.log")).expect("log file");
        let mut command = match launcher.split_first() {
            None => Command::new(binary("binxd")),
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(binary("binxd"));
                c
            }
        };
        let child = command
            .args(["--tcp-listen", tcp.unwrap_or("127.0.0.1:0")])
            .args(["--http-listen", http.unwrap_or("127.0.0.1:0")])
            .arg("--ready-file")
            .arg(&ready)
            .arg("--uds-path")
            .arg(&uds)
            .args(extra)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("BINX_LOG_LEVEL", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("binxd starts");
        let secret = extra
            .iter()
            .position(|a| *a == "--shared-secret")
            .and_then(|i| extra.get(i + 1))
            .map(|s| s.to_string());
        let mut daemon = Daemon {
            child,
            tcp: String::new(),
            http: String::new(),
            uds,
            dir,
            secret,
        };
        daemon.wait_ready_file(&ready);
        daemon.tcp = daemon.bound("tcp");
        daemon.http = daemon.bound("http");
        // binxd writes the ready file (atomically) once every listener is
        // bound, so nothing needs probing: a probe would hold a connection
        // slot the test may count on.
        daemon
    }

    /// An address from binxd's ready file: tcp, http, uds, admin, admin_tcp.
    pub(crate) fn bound(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.dir.0.join("ready")).expect("the ready file");
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("no {name} in the ready file: {text}"))
            .to_string()
    }

    /// Waits (20 s at most) until binxd has written its ready file.
    fn wait_ready_file(&mut self, ready: &Path) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if ready.exists() {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "binxd exited ({status}) before it listened; its log:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "binxd wrote no ready file in 20 s; its log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("binxd.log")).unwrap_or_default()
    }

    /// Whether binxd's log comes to contain `needle` within 20 s: binxd
    /// writes a line from its own threads, after the client that caused
    /// it has already seen its reply or its error, so a test that asserts
    /// on a log line waits for it (a plain `log().contains` right after
    /// the client's error is a race, and fails under load).
    pub(crate) fn log_shows(&self, needle: &str) -> bool {
        wait_until(Duration::from_secs(20), || self.log().contains(needle))
    }

    /// The stat `key` once `ready` holds for it, or its last value after
    /// 20 s (counters are bumped by the thread that served the request,
    /// which may be after the client saw its reply).
    pub(crate) fn stat_when(&self, key: &str, ready: impl Fn(u64) -> bool) -> u64 {
        let mut last = self.stat(key);
        wait_until(Duration::from_secs(20), || {
            last = self.stat(key);
            ready(last)
        });
        last
    }

    pub(crate) fn tcp_endpoint(&self) -> Endpoint {
        Endpoint::Tcp(self.tcp.clone())
    }

    pub(crate) fn uds_endpoint(&self) -> Endpoint {
        Endpoint::Unix(self.uds.clone())
    }

    pub(crate) fn connect_tcp(&self) -> Connection {
        Connection::new(self.tcp_endpoint(), ConnectionOptions::default())
    }

    pub(crate) fn connect_uds(&self) -> Connection {
        Connection::new(self.uds_endpoint(), ConnectionOptions::default())
    }

    /// A producer on this daemon's socket, with `task` opened as `buffers`
    /// partitioned buffers.
    pub(crate) async fn producer(&self, task: &str, buffers: u64) -> binx_client::Producer {
        let producer = binx_client::Producer::new(self.connect_uds());
        producer
            .open_task(task, &binx_client::TaskSpec::partitioned(buffers))
            .await
            .expect("OPEN_TASK");
        producer
    }

    /// The daemon's /v1/stats as JSON (plain blocking HTTP, so it works from
    /// any thread).
    pub(crate) fn stats(&self) -> serde_json::Value {
        stats_of(&self.http, self.secret.as_deref())
    }

    pub(crate) fn stat(&self, key: &str) -> u64 {
        self.stats()[key]
            .as_u64()
            .unwrap_or_else(|| panic!("stat {key} missing"))
    }

    /// Whether the process is still running.
    pub(crate) fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends a signal (TERM, INT, KILL, ...) without waiting.
    pub(crate) fn send_signal(&self, signal: &str) {
        send_signal(&self.child, signal);
    }

    /// Waits up to `limit` for the process to exit.
    pub(crate) fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let log = self.dir.0.join("binxd.log");
        wait_exit(&mut self.child, limit, &log)
    }

    /// Sends a signal and waits up to 10 s for the exit status.
    pub(crate) fn signal(&mut self, signal: &str) -> std::process::ExitStatus {
        self.send_signal(signal);
        self.wait_exit(Duration::from_secs(10))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `signal` (TERM, INT, KILL, ...) to `child` without waiting.
pub(crate) fn send_signal(child: &Child, signal: &str) {
    let pid = child.id().to_string();
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &pid])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill -{signal} {pid} failed");
}

/// Waits up to `limit` for a binxd `child` to exit; past it, fails with its
/// log.
pub(crate) fn wait_exit(
    child: &mut Child,
    limit: Duration,
    log: &Path,
) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "binxd did not exit within {limit:?}; log:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs the `binx` CLI against `daemon` (its socket, hence its admin socket).
pub(crate) fn binx(daemon: &Daemon, args: &[&str]) -> std::process::Output {
    Command::new(binary("binx"))
        .args(args)
        .env("BINX_UDS_PATH", &daemon.uds)
        .env_remove("BINX_ADMIN")
        .env_remove("BINX_SHARED_SECRET")
        .output()
        .expect("binx runs")
}

pub(crate) fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub(crate) fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A blocking HTTP/1.1 GET: (status code, body).
pub(crate) fn http_get(addr: &str, path: &str) -> (u16, String) {
    let response = http_request(addr, "GET", path, &[]);
    (
        response.status,
        String::from_utf8_lossy(&response.body).into_owned(),
    )
}

/// A bearer token as a Presto worker configured with `secret` sends it
/// (`X-Presto-Internal-Bearer`: HS256 with the SHA-256 of the secret),
/// valid for five minutes.
pub(crate) fn presto_bearer(secret: &str) -> String {
    let [sha, _] = binx_server::internal_auth::derived_keys(secret);
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
        + 300;
    binx_server::internal_auth::sign_token(&sha, "e2e-worker", exp)
}

/// /v1/stats of the binxd serving HTTP at `http`, with a bearer token when
/// it has a shared secret.
pub(crate) fn stats_of(http: &str, secret: Option<&str>) -> serde_json::Value {
    let token = secret.map(presto_bearer);
    let headers: Vec<(&str, &str)> = token
        .iter()
        .map(|t| ("X-Presto-Internal-Bearer", t.as_str()))
        .collect();
    let response = http_request(http, "GET", "/v1/stats", &headers);
    let body = String::from_utf8_lossy(&response.body).into_owned();
    assert_eq!(response.status, 200, "stats: {body}");
    serde_json::from_str(&body).expect("stats are JSON")
}

/// Deterministic pseudo-random numbers for test data.
pub(crate) fn rng(seed: u64) -> fastrand::Rng {
    fastrand::Rng::with_seed(seed)
}

/// A page size between 0 B and 1 MiB, log-uniform so that small and large
/// pages are both common (and 0 B and exactly 1 MiB occur).
pub(crate) fn page_size(rng: &mut fastrand::Rng) -> usize {
    match rng.u32(0..100) {
        0 => 0,
        1 => 1 << 20,
        _ => {
            let bits = rng.f64() * 20.0;
            (2f64.powf(bits) as usize).min(1 << 20)
        }
    }
}

/// SHA-256 over a stream of pages, each prefixed by its length, so page
/// boundaries count as much as the bytes.
#[derive(Clone, Default)]
pub(crate) struct StreamHash {
    hasher: sha2::Sha256,
    pub pages: u64,
    pub bytes: u64,
}

impl StreamHash {
    pub(crate) fn add(&mut self, page: &[u8]) {
        use sha2::Digest;
        self.hasher.update((page.len() as u64).to_be_bytes());
        self.hasher.update(page);
        self.pages += 1;
        self.bytes += page.len() as u64;
    }

    pub(crate) fn finish(self) -> (u64, u64, [u8; 32]) {
        use sha2::Digest;
        (self.pages, self.bytes, self.hasher.finalize().into())
    }
}

/// A parsed HTTP response.
pub(crate) struct HttpResponse {
    pub status: u16,
    pub headers: std::collections::HashMap<String, String>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub(crate) fn header(&self, name: &str) -> &str {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
            .unwrap_or_else(|| panic!("no header {name}; have {:?}", self.headers))
    }
}

/// A blocking HTTP/1.1 request with extra headers, made by hyper's client
/// on a thread of its own (so async tests can call it too); 30 s at most.
/// Hostile tests that need malformed requests write them on a raw socket.
pub(crate) fn http_request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> HttpResponse {
    use http_body_util::{BodyExt, Empty};
    let request = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| panic!("HTTP connect to {addr}: {e}"));
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .expect("HTTP handshake");
        tokio::spawn(connection);
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(Empty::<bytes::Bytes>::new())
            .expect("a valid HTTP request");
        let response = sender
            .send_request(request)
            .await
            .unwrap_or_else(|e| panic!("HTTP {method} {path}: {e}"));
        let status = response.status().as_u16();
        let headers = response
            .headers()
            .iter()
            .map(|(k, v)| {
                let value = String::from_utf8_lossy(v.as_bytes()).into_owned();
                (k.as_str().to_string(), value)
            })
            .collect();
        let body = response
            .into_body()
            .collect()
            .await
            .unwrap_or_else(|e| panic!("HTTP {method} {path} body: {e}"))
            .to_bytes()
            .to_vec();
        HttpResponse {
            status,
            headers,
            body,
        }
    };
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime for the HTTP client");
                runtime
                    .block_on(async {
                        tokio::time::timeout(Duration::from_secs(30), request).await
                    })
                    .unwrap_or_else(|_| panic!("HTTP {method} {path} took over 30 s"))
            })
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

/// A metric's value from the daemon's /metrics.
pub(crate) fn metric(daemon: &Daemon, name: &str) -> u64 {
    let (status, body) = http_get(&daemon.http, "/metrics");
    assert_eq!(status, 200);
    body.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

/// Runs `scripts/<script>` (which installs a test tool when it is missing)
/// and returns the path of the tool it prints.
pub(crate) fn ensure_tool(script: &str) -> String {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(repo.join("scripts").join(script))
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("scripts/{script} does not run: {e}"));
    assert!(out.status.success(), "scripts/{script} failed");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// binxd's peak resident set so far, in bytes (VmHWM).
pub(crate) fn peak_rss(daemon: &Daemon) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", daemon.child.id()))
        .expect("/proc status of binxd");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmHWM")
        * 1024
}

/// Polls `done` every 20 ms until it holds (true) or `limit` passes (false).
pub(crate) fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A raw HTTP/2 connection (prior knowledge) that asks nothing: the
/// client preface and an empty SETTINGS frame, then nothing but PINGs.
pub(crate) struct PingingHttp2 {
    pub(crate) stream: std::net::TcpStream,
}

/// A PING frame: length 8, type 6, no flags, stream 0, 8 bytes of data.
pub(crate) const HTTP2_PING: [u8; 17] = [0, 0, 8, 6, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8];

impl PingingHttp2 {
    pub(crate) fn open(addr: &str) -> PingingHttp2 {
        use std::io::Write;
        let mut stream = std::net::TcpStream::connect(addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_millis(100)))
            .expect("read timeout");
        let _ = stream.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        // An empty SETTINGS frame: length 0, type 4, no flags, stream 0.
        let _ = stream.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
        PingingHttp2 { stream }
    }

    /// Sends a PING every `every` and reads what comes back, until the
    /// server closes the connection (`Some(bytes received)`) or `limit`
    /// passes (`None`).
    pub(crate) fn ping_until_closed(&mut self, every: Duration, limit: Duration) -> Option<usize> {
        use std::io::{Read, Write};
        let until = Instant::now() + limit;
        let mut received = 0;
        let mut buf = [0u8; 4096];
        while Instant::now() < until {
            if self.stream.write_all(&HTTP2_PING).is_err() {
                return Some(received);
            }
            match self.stream.read(&mut buf) {
                Ok(0) => return Some(received),
                Ok(n) => received += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => return Some(received),
            }
            std::thread::sleep(every);
        }
        None
    }
}

/// A Unix socket in front of `target` that passes every connection through
/// both ways until its client has sent `cut_after` bytes, then closes it
/// without reading the rest (a sidecar that dies, or closes a connection,
/// while a request is being written to it). Stops when dropped.
pub(crate) struct CuttingRelay {
    pub(crate) path: PathBuf,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    accepting: Option<std::thread::JoinHandle<()>>,
}

impl CuttingRelay {
    pub(crate) fn start(dir: &Path, target: &Path, cut_after: usize) -> CuttingRelay {
        use std::io::{Read, Write};
        use std::os::unix::net::{UnixListener, UnixStream};
        let path = dir.join("cutting.sock");
        let listener = UnixListener::bind(&path).expect("relay socket");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let target = target.to_path_buf();
        let accepting = std::thread::spawn(move || {
            for client in listener.incoming() {
                if stopped.load(std::sync::atomic::Ordering::SeqCst) {
                    return;
                }
                let Ok(mut client) = client else { continue };
                let Ok(mut daemon) = UnixStream::connect(&target) else {
                    continue;
                };
                let (Ok(mut to_client), Ok(mut from_daemon)) =
                    (client.try_clone(), daemon.try_clone())
                else {
                    continue;
                };
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from_daemon, &mut to_client);
                });
                std::thread::spawn(move || {
                    let mut passed = 0;
                    let mut chunk = vec![0u8; 16 << 10];
                    while passed < cut_after {
                        let want = chunk.len().min(cut_after - passed);
                        match client.read(&mut chunk[..want]) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                if daemon.write_all(&chunk[..n]).is_err() {
                                    break;
                                }
                                passed += n;
                            }
                        }
                    }
                    let _ = client.shutdown(std::net::Shutdown::Both);
                    let _ = daemon.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        CuttingRelay {
            path,
            stop,
            accepting: Some(accepting),
        }
    }
}

impl Drop for CuttingRelay {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        // Wakes the accepting thread, which then sees the flag.
        let _ = std::os::unix::net::UnixStream::connect(&self.path);
        if let Some(accepting) = self.accepting.take() {
            let _ = accepting.join();
        }
    }
}
