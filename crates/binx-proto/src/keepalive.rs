//! How both ends of a BinX TCP connection have the kernel find a peer that
//! is gone (its node powered off, the path black-holed): keepalive probes
//! while the socket is idle, and a limit on how long sent bytes may stay
//! unacknowledged, rather than the quarter hour of retransmits a socket
//! keeps by default. binx-client and binxd set the same probes; each
//! chooses the limit from its own timeouts.

use std::time::Duration;

/// Idle time before the kernel probes a socket.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
/// Time between probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// Probes unanswered before the kernel gives up.
pub const KEEPALIVE_PROBES: u32 = 3;

/// Sets keepalive on a TCP socket and, when given, `TCP_USER_TIMEOUT`
/// (with it set, Linux also closes an idle socket whose probes go
/// unanswered only once that much has passed).
pub fn keep_alive(
    stream: &impl std::os::fd::AsFd,
    unacknowledged: Option<Duration>,
) -> std::io::Result<()> {
    let socket = socket2::SockRef::from(stream);
    socket.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(KEEPALIVE_IDLE)
            .with_interval(KEEPALIVE_INTERVAL)
            .with_retries(KEEPALIVE_PROBES),
    )?;
    match unacknowledged {
        Some(limit) => socket.set_tcp_user_timeout(Some(limit)),
        None => Ok(()),
    }
}
