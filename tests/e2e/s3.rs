//! A real S3 protocol server (s3s over s3s-fs) that tests start in their
//! own process on 127.0.0.1, with credentials, and can stop and start again
//! on the same port with the same objects (to make the store unreachable).

use std::net::SocketAddr;
use std::path::PathBuf;

use hyper_util::rt::TokioIo;
use s3s::auth::SimpleAuth;
use s3s::service::S3ServiceBuilder;
use std::time::Duration;
use tokio::net::TcpListener;

use crate::common::TempDir;

pub(crate) const ACCESS_KEY: &str = "binx-test-access";
pub(crate) const SECRET_KEY: &str = "binx-test-secret-key";
pub(crate) const BUCKET: &str = "spool";

pub(crate) struct S3Server {
    pub addr: SocketAddr,
    pub root: TempDir,
    /// Its own runtime on its own thread, so a test that blocks its
    /// threads (waiting for a daemon) never stalls the store.
    thread: Option<(
        tokio::sync::oneshot::Sender<()>,
        std::thread::JoinHandle<()>,
    )>,
}

impl S3Server {
    /// Starts a server with an empty bucket `spool` on loopback.
    pub(crate) fn start() -> S3Server {
        S3Server::start_on("127.0.0.1")
    }

    /// The same on a free port of `ip` (the bridge of the netns tests).
    /// The port is drawn below the kernel's ephemeral range, where no port-0
    /// listener of the run lands, and apart from the emulators' ports
    /// (`spawn_on_port`), so [`S3Server::restart`] finds it free again after
    /// an outage; a port taken already is skipped at bind.
    pub(crate) fn start_on(ip: &str) -> S3Server {
        let root = TempDir::new("s3");
        std::fs::create_dir_all(root.0.join(BUCKET)).expect("bucket dir");
        let listener = (0..100)
            .find_map(|_| std::net::TcpListener::bind((ip, fastrand::u16(20_000..26_000))).ok())
            .expect("bind s3");
        let addr = listener.local_addr().expect("s3 addr");
        let mut server = S3Server {
            addr,
            root,
            thread: None,
        };
        server.serve(listener);
        server
    }

    fn serve(&mut self, listener: std::net::TcpListener) {
        let fs = s3s_fs::FileSystem::new(&self.root.0).expect("s3s-fs root");
        let mut builder = S3ServiceBuilder::new(fs);
        builder.set_auth(SimpleAuth::from_single(ACCESS_KEY, SECRET_KEY));
        let service = builder.build();
        listener.set_nonblocking(true).expect("nonblocking");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("s3 runtime");
            runtime.block_on(async move {
                let listener = TcpListener::from_std(listener).expect("tokio listener");
                let accept = async {
                    loop {
                        let Ok((socket, _)) = listener.accept().await else {
                            continue;
                        };
                        let service = service.clone();
                        tokio::spawn(async move {
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(socket), service)
                                .await;
                        });
                    }
                };
                tokio::select! {
                    () = accept => {}
                    _ = stop_rx => {}
                }
            });
            // Open connections are cut here, with the runtime.
            runtime.shutdown_timeout(Duration::from_secs(2));
        });
        self.thread = Some((stop_tx, thread));
    }

    /// Closes the port and every open connection.
    pub(crate) fn stop(&mut self) {
        if let Some((stop, thread)) = self.thread.take() {
            let _ = stop.send(());
            let _ = thread.join();
        }
    }

    /// Serves again on the same port, with the objects it held.
    pub(crate) fn restart(&mut self) {
        self.stop();
        let listener = std::net::TcpListener::bind(self.addr).expect("rebind s3 port");
        self.serve(listener);
    }

    /// The flags that point a binxd at this server.
    pub(crate) fn daemon_flags(&self, prefix: &str) -> Vec<String> {
        [
            "--spool-stores",
            &format!("s3://{BUCKET}/{prefix}"),
            "--spool-s3-endpoint",
            &format!("http://{}", self.addr),
            "--spool-s3-region",
            "us-east-1",
            "--spool-s3-access-key-id",
            ACCESS_KEY,
            "--spool-s3-secret-access-key",
            SECRET_KEY,
            "--spool-allow-http",
            "true",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    /// Files of the objects under `prefix` in the bucket.
    pub(crate) fn objects(&self, prefix: &str) -> Vec<PathBuf> {
        list_files(&self.root.0.join(BUCKET).join(prefix))
    }
}

/// Regular files in a directory (not recursive), sorted; none if it is missing.
pub(crate) fn list_files(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}
