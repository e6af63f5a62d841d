//! A TCP proxy that the test controls: it forwards both directions and cuts
//! each connection after a random number of bytes, in the middle of whatever
//! frame is passing.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub(crate) struct ChaosProxy {
    pub addr: String,
    kills: Arc<AtomicU64>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for ChaosProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl ChaosProxy {
    /// Proxies to `upstream`; each connection is cut after a number of bytes
    /// (both directions together) drawn from `min_bytes..max_bytes`.
    pub(crate) async fn start(
        upstream: String,
        seed: u64,
        min_bytes: u64,
        max_bytes: u64,
    ) -> ChaosProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy bind");
        let addr = listener.local_addr().expect("proxy addr").to_string();
        let kills = Arc::new(AtomicU64::new(0));
        let counter = kills.clone();
        let accept = tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(seed);
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let budget = rng.u64(min_bytes..max_bytes);
                let upstream = upstream.clone();
                let counter = counter.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    if pump(client, server, budget).await {
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        });
        ChaosProxy {
            addr,
            kills,
            accept,
        }
    }

    /// Connections cut so far.
    pub(crate) fn kills(&self) -> u64 {
        self.kills.load(Ordering::Relaxed)
    }
}

/// Forwards until either side closes (false) or the budget is spent (true:
/// both sockets are dropped mid-stream).
async fn pump(mut client: TcpStream, mut server: TcpStream, budget: u64) -> bool {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let mut up = vec![0u8; 64 * 1024];
    let mut down = vec![0u8; 64 * 1024];
    let mut moved = 0u64;
    loop {
        let (n, to_server) = tokio::select! {
            r = client.read(&mut up) => (r.unwrap_or(0), true),
            r = server.read(&mut down) => (r.unwrap_or(0), false),
        };
        if n == 0 {
            return false;
        }
        // Forward only what fits the budget, so the cut lands inside a frame.
        let allowed = (budget - moved).min(n as u64) as usize;
        let result = if to_server {
            server.write_all(&up[..allowed]).await
        } else {
            client.write_all(&down[..allowed]).await
        };
        moved += allowed as u64;
        if result.is_err() {
            return false;
        }
        if moved >= budget {
            return true;
        }
    }
}

/// A TCP relay that can black-hole the connections it carries: once frozen,
/// nothing more passes either way on them, yet their sockets stay open (a
/// peer gone without a FIN or RST, a path that drops every packet; the
/// kernel acknowledges nothing the relay does not read). Connections it
/// accepts later are carried again.
pub(crate) struct FreezingRelay {
    pub addr: String,
    accepted: Arc<AtomicU64>,
    frozen: tokio::sync::watch::Sender<u64>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for FreezingRelay {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl FreezingRelay {
    pub(crate) async fn start(upstream: String) -> FreezingRelay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("relay bind");
        let addr = listener.local_addr().expect("relay addr").to_string();
        let accepted = Arc::new(AtomicU64::new(0));
        let (frozen, watch) = tokio::sync::watch::channel(0u64);
        let counter = accepted.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                // Freezes from here on apply to this connection.
                let generation = *watch.borrow();
                counter.fetch_add(1, Ordering::SeqCst);
                let upstream = upstream.clone();
                let mut watch = watch.clone();
                tokio::spawn(async move {
                    let mut client = client;
                    let Ok(mut server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let frozen = async {
                        loop {
                            if *watch.borrow_and_update() > generation {
                                return true;
                            }
                            if watch.changed().await.is_err() {
                                return false;
                            }
                        }
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => return,
                        true = frozen => (),
                        else => return,
                    }
                    // Both sockets held open, unread, until the relay goes.
                    while watch.changed().await.is_ok() {}
                    drop((client, server));
                });
            }
        });
        FreezingRelay {
            addr,
            accepted,
            frozen,
            accept,
        }
    }

    /// Black-holes every connection accepted so far.
    pub(crate) fn freeze(&self) {
        self.frozen.send_modify(|g| *g += 1);
    }

    /// Connections accepted so far.
    pub(crate) fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }
}
