//! BinX over TCP with TLS (rustls): pages move intact; a client without the
//! right CA, a plain-TCP client and, under mutual TLS, a client without a
//! certificate from the cluster's CA are refused with the reason, while the
//! daemon goes on serving; the proxy consumer forwards over mutual TLS.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use binx_client::{Connection, ConnectionOptions, ExchangeSource, SourceConfig, tls};
use bytes::Bytes;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

use crate::common::{Daemon, TempDir, binary, stderr};

/// A CA, and certificates it signed, as PEM files in a directory.
struct Pki {
    dir: TempDir,
    ca: rcgen::Certificate,
    ca_key: KeyPair,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let dir = TempDir::new(&format!("pki-{name}"));
        let ca_key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} CA"));
        let ca = params.self_signed(&ca_key).unwrap();
        std::fs::write(dir.0.join("ca.pem"), ca.pem()).unwrap();
        Pki { dir, ca, ca_key }
    }

    fn ca_file(&self) -> PathBuf {
        self.dir.0.join("ca.pem")
    }

    /// Certificate and key files for `names` (IP addresses become IP SANs).
    fn issue(&self, label: &str, names: &[&str]) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().unwrap();
        let params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        let (cert_file, key_file) = (
            self.dir.0.join(format!("{label}.pem")),
            self.dir.0.join(format!("{label}-key.pem")),
        );
        std::fs::write(&cert_file, cert.pem()).unwrap();
        std::fs::write(&key_file, key.serialize_pem()).unwrap();
        (cert_file, key_file)
    }
}

fn tls_flags<'a>(cert: &'a Path, key: &'a Path, ca: &'a Path, mutual: bool) -> Vec<&'a str> {
    let mut flags = vec![
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
        "--tls-ca",
        ca.to_str().unwrap(),
    ];
    if mutual {
        flags.extend(["--tls-client-auth", "true"]);
    }
    flags
}

fn client(daemon: &Daemon, tls: Option<Arc<rustls::ClientConfig>>) -> Connection {
    Connection::new(
        daemon.tcp_endpoint(),
        ConnectionOptions {
            tls,
            ..ConnectionOptions::default()
        },
    )
}

async fn produce(daemon: &Daemon, task: &str, pages: &[Bytes]) {
    let producer = daemon.producer(task, 1).await;
    producer.enqueue(task, 0, pages).await.unwrap();
    producer.no_more_pages(task, None).await.unwrap();
}

async fn read_all(connection: Connection, task: &str) -> Vec<Bytes> {
    let mut source = ExchangeSource::new(connection, task, 0, SourceConfig::default());
    let mut got = Vec::new();
    while let Some(page) = source.next_page().await.unwrap() {
        got.push(page.data);
    }
    got
}

fn test_pages() -> Vec<Bytes> {
    (0..50u32)
        .map(|i| Bytes::from(vec![i as u8; 1000 + i as usize * 977]))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_cross_tls_intact_and_wrong_clients_are_refused_with_the_reason() {
    let pki = Pki::new("cluster");
    let (cert, key) = pki.issue("binxd", &["127.0.0.1", "localhost"]);
    let daemon = Daemon::start(&tls_flags(&cert, &key, &pki.ca_file(), false));
    let pages = test_pages();
    produce(&daemon, "tls.q1", &pages).await;

    let trusted = tls::client_config(&pki.ca_file(), None).unwrap();
    assert_eq!(
        read_all(client(&daemon, Some(trusted.clone())), "tls.q1").await,
        pages
    );

    // A client that trusts another CA: the handshake fails, naming why.
    let other = Pki::new("other");
    let untrusted = tls::client_config(&other.ca_file(), None).unwrap();
    let err = client(&daemon, Some(untrusted)).ping().await.unwrap_err();
    assert!(err.to_string().contains("TLS handshake failed"), "{err}");
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "{err}"
    );

    // Plain TCP to a TLS listener: refused, and binxd says why in its log.
    let err = client(&daemon, None).ping().await.unwrap_err();
    assert!(
        matches!(
            err,
            binx_client::ClientError::Connect { .. }
                | binx_client::ClientError::ConnectionLost { .. }
                | binx_client::ClientError::Preface { .. }
        ),
        "{err}"
    );
    assert!(daemon.log_shows("TLS handshake failed"), "{}", daemon.log());

    // The daemon still serves: TCP with TLS, and the Unix socket without.
    client(&daemon, Some(trusted)).ping().await.unwrap();
    daemon.connect_uds().ping().await.unwrap();

    // The CLI speaks TLS with --tls-ca.
    let out = std::process::Command::new(binary("binx"))
        .args(["ping", "--count", "2", "--remote", &daemon.tcp, "--tls-ca"])
        .arg(pki.ca_file())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_admits_only_certificates_of_the_cluster_ca() {
    let pki = Pki::new("cluster");
    let (cert, key) = pki.issue("binxd", &["127.0.0.1"]);
    let daemon = Daemon::start(&tls_flags(&cert, &key, &pki.ca_file(), true));
    let pages = test_pages();
    produce(&daemon, "mtls.q1", &pages).await;

    // No client certificate.
    let anonymous = tls::client_config(&pki.ca_file(), None).unwrap();
    let err = client(&daemon, Some(anonymous)).ping().await.unwrap_err();
    assert!(
        err.to_string().contains("the server ended the TLS session")
            && err.to_string().contains("CertificateRequired"),
        "{err}"
    );
    // A certificate from another CA.
    let other = Pki::new("other");
    let (stranger_cert, stranger_key) = other.issue("stranger", &["stranger"]);
    let stranger =
        tls::client_config(&pki.ca_file(), Some((&stranger_cert, &stranger_key))).unwrap();
    let err = client(&daemon, Some(stranger)).ping().await.unwrap_err();
    assert!(
        err.to_string().contains("the server ended the TLS session")
            && err.to_string().contains("UnknownCA"),
        "{err}"
    );
    // One of the cluster's: served, every byte.
    let (worker_cert, worker_key) = pki.issue("worker", &["worker-1"]);
    let member = tls::client_config(&pki.ca_file(), Some((&worker_cert, &worker_key))).unwrap();
    assert_eq!(
        read_all(client(&daemon, Some(member)), "mtls.q1").await,
        pages
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_consumer_forwards_over_mutual_tls() {
    let pki = Pki::new("cluster");
    let (a_cert, a_key) = pki.issue("a", &["127.0.0.1"]);
    let (b_cert, b_key) = pki.issue("b", &["127.0.0.1"]);
    let producer_side = Daemon::start(&tls_flags(&a_cert, &a_key, &pki.ca_file(), true));
    let consumer_side = Daemon::start(&tls_flags(&b_cert, &b_key, &pki.ca_file(), true));
    let pages = test_pages();
    produce(&producer_side, "fwd.q1", &pages).await;
    // The engine reads through its own Unix socket; its binxd forwards over
    // mutual TLS, presenting its own certificate.
    let mut source = ExchangeSource::new(
        consumer_side.connect_uds(),
        "fwd.q1",
        0,
        SourceConfig {
            remote: Some(producer_side.tcp.clone()),
            ..SourceConfig::default()
        },
    );
    let mut got = Vec::new();
    while let Some(page) = source.next_page().await.unwrap() {
        got.push(page.data);
    }
    assert_eq!(got, pages);
}

#[test]
fn incomplete_or_unreadable_tls_settings_stop_binxd_naming_them() {
    let pki = Pki::new("cluster");
    let (cert, key) = pki.issue("binxd", &["127.0.0.1"]);
    let (cert, key, ca) = (
        cert.to_str().unwrap().to_string(),
        key.to_str().unwrap().to_string(),
        pki.ca_file().to_str().unwrap().to_string(),
    );
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--tls-cert", &cert],
            "tls_cert and tls_key go together",
        ),
        (
            vec!["--tls-cert", &cert, "--tls-key", "/no/such/key.pem"],
            "/no/such/key.pem",
        ),
        (
            vec![
                "--tls-cert",
                &cert,
                "--tls-key",
                &key,
                "--tls-client-auth",
                "true",
            ],
            "tls_ca is not set",
        ),
        (vec!["--tls-ca", "/no/such/ca.pem"], "/no/such/ca.pem"),
        (vec!["--tls-cert", &ca, "--tls-key", &ca], "key"),
    ];
    for (flags, named) in cases {
        let out = std::process::Command::new(binary("binxd"))
            .args(&flags)
            .arg("--print-config")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{flags:?} was accepted");
        assert!(stderr(&out).contains(named), "{flags:?}: {}", stderr(&out));
    }
}

/// Whether this kernel takes TLS keys: `BINX_TEST_EXPECT_KERNEL_TLS` (1 or
/// 0) says so where the runner knows (scripts/ktls-vm.sh sets 1), else the
/// probe binxd itself runs decides.
fn kernel_tls_expected() -> bool {
    match std::env::var("BINX_TEST_EXPECT_KERNEL_TLS").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => binx_ktls::KernelTls::probe().offered(),
    }
}

/// Pages whose sizes fall on and beside TLS record sizes (16 KiB), plus
/// one larger than a whole reply.
fn record_edge_pages() -> Vec<Bytes> {
    let sizes = [
        1usize,
        16383,
        16384,
        16385,
        16384 * 3 + 1,
        (1 << 20) + 7,
        5 << 20,
        0,
        2,
    ];
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            Bytes::from(
                (0..n)
                    .map(|j| (j as u32).wrapping_mul(2654435761).wrapping_add(i as u32) as u8)
                    .collect::<Vec<u8>>(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_tls_moves_the_same_bytes_where_offered_and_rustls_serves_elsewhere() {
    let expected = kernel_tls_expected();
    let pki = Pki::new("cluster");
    let (cert, key) = pki.issue("binxd", &["127.0.0.1"]);
    let trusted = tls::client_config(&pki.ca_file(), None).unwrap();
    let pages = record_edge_pages();
    let ca = pki.ca_file();
    let kernel = Daemon::start(&tls_flags(&cert, &key, &ca, false));
    let mut off_flags = tls_flags(&cert, &key, &ca, false);
    off_flags.extend(["--tls-kernel", "false"]);
    let rustls_only = Daemon::start(&off_flags);
    for daemon in [&kernel, &rustls_only] {
        // Four buffers, read at once over connections of their own, twice
        // (each read a new connection and handshake).
        let producer = daemon.producer("ktls.q1", 4).await;
        for buffer in 0..4 {
            producer.enqueue("ktls.q1", buffer, &pages).await.unwrap();
            producer.enqueue("ktls.q1", buffer, &pages).await.unwrap();
        }
        producer.no_more_pages("ktls.q1", None).await.unwrap();
        let reads = (0..4u64).map(|buffer| {
            let connection = client(daemon, Some(trusted.clone()));
            tokio::spawn(async move {
                let mut source =
                    ExchangeSource::new(connection, "ktls.q1", buffer, SourceConfig::default());
                let mut got = Vec::new();
                while let Some(page) = source.next_page().await.unwrap() {
                    got.push(page.data);
                }
                got
            })
        });
        let want: Vec<Bytes> = pages.iter().chain(pages.iter()).cloned().collect();
        for read in futures_util::future::join_all(reads).await {
            assert_eq!(read.unwrap(), want);
        }
        // Many small requests on one connection: the server's receive side.
        let connection = client(daemon, Some(trusted.clone()));
        for _ in 0..200 {
            connection.ping().await.unwrap();
        }
        drop(connection);
        // A client that goes away mid-stream does not upset the daemon.
        let out = std::process::Command::new(binary("binx"))
            .args(["ping", "--count", "3", "--remote", &daemon.tcp, "--tls-ca"])
            .arg(pki.ca_file())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        client(daemon, Some(trusted.clone())).ping().await.unwrap();
        assert_eq!(daemon.stat("protocol_errors"), 0, "{}", daemon.log());
    }
    let (in_kernel, in_rustls) = (
        kernel.stat("tls_kernel_total"),
        kernel.stat("tls_rustls_total"),
    );
    if expected {
        assert!(
            in_kernel >= 7,
            "kernel {in_kernel}, rustls {in_rustls}: {}",
            kernel.log()
        );
        assert_eq!(in_rustls, 0, "{}", kernel.log());
    } else {
        assert_eq!(in_kernel, 0);
        assert!(in_rustls >= 7, "kernel {in_kernel}, rustls {in_rustls}");
        assert!(
            kernel.log_shows("kernel TLS is not offered here"),
            "{}",
            kernel.log()
        );
    }
    assert_eq!(rustls_only.stat("tls_kernel_total"), 0);
    assert!(rustls_only.stat_when("tls_rustls_total", |n| n >= 7) >= 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_tls_record_closes_only_its_own_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let pki = Pki::new("cluster");
    let (cert, key) = pki.issue("binxd", &["127.0.0.1"]);
    let daemon = Daemon::start(&tls_flags(&cert, &key, &pki.ca_file(), false));
    let trusted = tls::client_config(&pki.ca_file(), None).unwrap();
    let tcp = tokio::net::TcpStream::connect(&daemon.tcp).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut stream = tokio_rustls::TlsConnector::from(trusted.clone())
        .connect(name, tcp)
        .await
        .unwrap();
    // Sent once binxd has handed the connection on (to the kernel, or to
    // rustls for good): a record arriving during the handover would be
    // rustls' to refuse, not the kernel's.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while daemon.stat("tls_kernel_total") + daemon.stat("tls_rustls_total") == 0 {
        assert!(std::time::Instant::now() < deadline, "{}", daemon.log());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // An application-data record no key sealed, written under rustls: the
    // kernel (or rustls, without kernel TLS) finds its tag wrong.
    let mut forged = vec![23, 3, 3, 0, 64];
    forged.extend([0x5a; 64]);
    stream.get_mut().0.write_all(&forged).await.unwrap();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(std::time::Duration::from_secs(30), stream.read(&mut buf))
        .await
        .expect("the daemon closes the connection");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    if kernel_tls_expected() {
        // The daemon logs why it closed the connection.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !daemon.log().contains("a TLS record failed authentication")
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(
            daemon.log().contains("a TLS record failed authentication"),
            "{}",
            daemon.log()
        );
    }
    // Everyone else is served as before.
    let pages = test_pages();
    produce(&daemon, "forged.q1", &pages).await;
    assert_eq!(
        read_all(client(&daemon, Some(trusted)), "forged.q1").await,
        pages
    );
}

/// Forwards to `target`, passing the client's bytes on a few at a time with
/// pauses between, so that whatever the client sends right after its TLS
/// Finished reaches binxd in pieces: the handshake's last read then ends
/// inside the record after it.
async fn dribbling_proxy(target: String) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let Ok(server) = tokio::net::TcpStream::connect(&target).await else {
                    return;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
                });
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = client_read.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    for piece in buf[..n].chunks(7) {
                        if server_write.write_all(piece).await.is_err() {
                            return;
                        }
                        tokio::time::sleep(std::time::Duration::from_micros(300)).await;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_arriving_in_pieces_after_the_handshake_is_served_whole() {
    let pki = Pki::new("cluster");
    let (cert, key) = pki.issue("binxd", &["127.0.0.1"]);
    let daemon = Daemon::start(&tls_flags(&cert, &key, &pki.ca_file(), false));
    let pages = test_pages();
    produce(&daemon, "dribble.q1", &pages).await;
    let proxy = dribbling_proxy(daemon.tcp.clone()).await;
    let trusted = tls::client_config(&pki.ca_file(), None).unwrap();
    for _ in 0..3 {
        // Each a new connection: its preface and HELLO follow the Finished.
        let connection = Connection::new(
            binx_client::Endpoint::Tcp(proxy.clone()),
            ConnectionOptions {
                tls: Some(trusted.clone()),
                ..ConnectionOptions::default()
            },
        );
        connection.ping().await.unwrap();
    }
    let connection = Connection::new(
        binx_client::Endpoint::Tcp(proxy),
        ConnectionOptions {
            tls: Some(trusted),
            ..ConnectionOptions::default()
        },
    );
    assert_eq!(read_all(connection, "dribble.q1").await, pages);
    assert_eq!(daemon.stat("protocol_errors"), 0, "{}", daemon.log());
    if kernel_tls_expected() {
        assert!(
            daemon.stat_when("tls_kernel_total", |n| n >= 4) >= 4,
            "{}",
            daemon.log()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_1_2_client_is_served_by_rustls_even_where_the_kernel_takes_tls_1_3() {
    let pki = Pki::new("cluster");
    let (cert, key) = pki.issue("binxd", &["127.0.0.1"]);
    let daemon = Daemon::start(&tls_flags(&cert, &key, &pki.ca_file(), false));
    let pages = test_pages();
    produce(&daemon, "tls12.q1", &pages).await;
    let tls12 = Arc::new(
        rustls::ClientConfig::builder_with_provider(tls::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS12])
            .unwrap()
            .with_root_certificates(tls::root_store(&pki.ca_file()).unwrap())
            .with_no_client_auth(),
    );
    assert_eq!(
        read_all(client(&daemon, Some(tls12)), "tls12.q1").await,
        pages
    );
    assert_eq!(daemon.stat("tls_kernel_total"), 0);
    assert_eq!(daemon.stat("tls_rustls_total"), 1);
}
