//! Dialling a daemon by name, the same address for every stripe.
//!
//! A connection's stripes are one connection to one daemon: one buffer's
//! pipelined DATA goes round them. A name may resolve to several addresses
//! (DNS round robin, a Service in front of several pods, IPv4 and IPv6 of
//! one host), and dialling it afresh for each stripe could reach a different
//! daemon on each. So the first stripe to connect by name pins the address
//! it reached, and every later stripe dials that address. Only when the
//! pinned address cannot be reached (the daemon moved) is the name resolved
//! again, and the address that answers then is pinned instead.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Mutex;

use tokio::net::TcpStream;

/// The address a connection's stripes dial (see the module's doc).
#[derive(Debug, Default)]
pub(crate) struct PinnedAddress {
    at: Mutex<Option<SocketAddr>>,
}

impl PinnedAddress {
    /// A stream to the daemon `name` (`host:port`) names: the pinned
    /// address while it answers, else the first of the name's addresses
    /// that does, which is pinned from then on.
    pub(crate) async fn dial(&self, name: &str) -> io::Result<TcpStream> {
        self.dial_with(name, |name| async move {
            Ok(tokio::net::lookup_host(name).await?.collect())
        })
        .await
    }

    /// [`PinnedAddress::dial`] with the name resolved by `resolve`.
    async fn dial_with<R, F>(&self, name: &str, resolve: R) -> io::Result<TcpStream>
    where
        R: FnOnce(String) -> F,
        F: Future<Output = io::Result<Vec<SocketAddr>>>,
    {
        let pinned = *self.at.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(at) = pinned {
            match TcpStream::connect(at).await {
                Ok(stream) => return Ok(stream),
                Err(e) => tracing::debug!(
                    "{name}: the pinned address {at} did not answer ({e}); resolving the name again"
                ),
            }
        }
        let addresses = resolve(name.to_string()).await?;
        let mut last = io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name} resolves to no address"),
        );
        for at in addresses {
            match TcpStream::connect(at).await {
                Ok(stream) => {
                    *self.at.lock().unwrap_or_else(|p| p.into_inner()) = Some(at);
                    return Ok(stream);
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// Whether `listener` has a connection waiting to be accepted.
    async fn accepted(listener: &TcpListener) -> bool {
        tokio::time::timeout(std::time::Duration::from_millis(200), listener.accept())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn every_stripe_dials_the_address_the_first_reached_until_it_stops_answering() {
        // A name with two addresses, the first of which has no daemon yet.
        let second = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let first_at = {
            let probe = TcpListener::bind("127.0.0.2:0").await.unwrap();
            probe.local_addr().unwrap()
        };
        let addresses = vec![first_at, second.local_addr().unwrap()];
        let resolve = |_: String| {
            let addresses = addresses.clone();
            async move { Ok(addresses) }
        };
        let pinned = PinnedAddress::default();

        let _a = pinned.dial_with("daemon:1", resolve).await.unwrap();
        assert!(
            accepted(&second).await,
            "the first stripe reached the address that answers"
        );

        // A daemon now answers at the name's first address too: a fresh
        // resolution would dial it, a different daemon.
        let first = TcpListener::bind(first_at).await.unwrap();
        let _b = pinned.dial_with("daemon:1", resolve).await.unwrap();
        assert!(
            accepted(&second).await,
            "a later stripe dials the pinned address"
        );
        assert!(
            !accepted(&first).await,
            "no stripe reached the other daemon"
        );

        // The pinned daemon goes away: the name is resolved again, and the
        // address that answers is pinned.
        drop(second);
        let _c = pinned.dial_with("daemon:1", resolve).await.unwrap();
        assert!(accepted(&first).await);
        let _d = pinned.dial_with("daemon:1", resolve).await.unwrap();
        assert!(accepted(&first).await);
    }

    #[tokio::test]
    async fn a_name_with_no_address_that_answers_is_an_error_that_names_it() {
        let gone = {
            let probe = TcpListener::bind("127.0.0.1:0").await.unwrap();
            probe.local_addr().unwrap()
        };
        let pinned = PinnedAddress::default();
        let e = pinned
            .dial_with("daemon:1", |_| async { Ok(Vec::new()) })
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("daemon:1 resolves to no address"),
            "{e}"
        );
        let e = pinned
            .dial_with("daemon:1", |_| async move { Ok(vec![gone]) })
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
    }
}
