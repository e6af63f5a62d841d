//! Three "pods": network namespaces joined by veth pairs through a bridge,
//! each running one binxd as a pod would (BinX and HTTP on its own address,
//! its socket for its engine). The test plays every pod's engine through
//! that pod's socket; consumers read remote buffers through their own
//! sidecar (proxy consumer), so every page crosses the bridge. Faults, one
//! per test: a link cut for 5 s, a SIGKILLed producer under spool policy
//! `always` (storage: the real S3 server, on the bridge), a SIGTERM drain.
//!
//! Namespaces need root and `ip`. Where they cannot be made, each test says
//! so on stderr and writes a line to target/skipped-tests, which .ci/run
//! reports as skipped (`common::skipped`).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use binx_client::{Connection, ConnectionOptions, Endpoint, ExchangeSource, SourceConfig};
use binx_proto::BufferKind;
use bytes::Bytes;
use sha2::{Digest, Sha256};

use crate::common::{TempDir, binary, http_get, rng};
use crate::s3::S3Server;

const SECRET: &str = "netns-cluster-secret";
const PODS: usize = 3;

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The namespaces, the bridge and the veth pairs of one test.
struct Network {
    tag: String,
    subnet: String,
}

impl Network {
    fn create() -> Result<Network, String> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = (std::process::id() % 60) * 4 + NEXT.fetch_add(1, Ordering::Relaxed) % 4;
        let network = Network {
            tag: format!("bx{n}"),
            subnet: format!("10.79.{n}"),
        };
        network.teardown();
        let bridge = network.bridge();
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        ip(&[
            "addr",
            "add",
            &format!("{}.254/24", network.subnet),
            "dev",
            &bridge,
        ])?;
        ip(&["link", "set", &bridge, "up"])?;
        for pod in 0..PODS {
            let (ns, host, peer) = (
                network.ns(pod),
                network.host_end(pod),
                network.peer_end(pod),
            );
            ip(&["netns", "add", &ns])?;
            ip(&["link", "add", &host, "type", "veth", "peer", "name", &peer])?;
            ip(&["link", "set", &peer, "netns", &ns])?;
            ip(&["link", "set", &host, "master", &bridge, "up"])?;
            let addr = format!("{}/24", network.pod_ip(pod));
            ip(&["-n", &ns, "addr", "add", &addr, "dev", &peer])?;
            ip(&["-n", &ns, "link", "set", &peer, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(network)
    }

    fn bridge(&self) -> String {
        format!("{}br", self.tag)
    }
    fn ns(&self, pod: usize) -> String {
        format!("{}ns{pod}", self.tag)
    }
    fn host_end(&self, pod: usize) -> String {
        format!("{}h{pod}", self.tag)
    }
    fn peer_end(&self, pod: usize) -> String {
        format!("{}p{pod}", self.tag)
    }
    fn pod_ip(&self, pod: usize) -> String {
        format!("{}.{}", self.subnet, pod + 1)
    }
    fn bridge_ip(&self) -> String {
        format!("{}.254", self.subnet)
    }

    /// Takes a pod's link down (or up): its packets go nowhere meanwhile.
    fn link(&self, pod: usize, up: bool) {
        ip(&[
            "link",
            "set",
            &self.host_end(pod),
            if up { "up" } else { "down" },
        ])
        .expect("link state");
    }

    fn teardown(&self) {
        for pod in 0..PODS {
            let _ = ip(&["netns", "del", &self.ns(pod)]);
            let _ = ip(&["link", "del", &self.host_end(pod)]);
        }
        let _ = ip(&["link", "del", &self.bridge()]);
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// Creates the network, or says loudly why this test is skipped.
fn network_or_skip(test: &str) -> Option<Network> {
    match Network::create() {
        Ok(network) => Some(network),
        Err(why) => {
            crate::common::skipped(test, &format!("network namespaces unavailable: {why}"));
            None
        }
    }
}

/// One binxd in a namespace, as a pod's sidecar.
struct Pod {
    child: Child,
    binx: String,
    http: String,
    uds: PathBuf,
    _dir: TempDir,
}

impl Pod {
    fn start(network: &Network, pod: usize, extra: &[String]) -> Pod {
        let dir = TempDir::new(&format!("pod{pod}"));
        let addr = network.pod_ip(pod);
        let (binx, http) = (format!("{addr}:8091"), format!("{addr}:8090"));
        let uds = dir.0.join("binx.sock");
        let log = std::fs::File::create(dir.0.join("binxd.log")).unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", &network.ns(pod)])
            .arg(binary("binxd"))
            .args(["--tcp-listen", &binx, "--http-listen", &http])
            .arg("--uds-path")
            .arg(&uds)
            .args(["--shared-secret", SECRET, "--name", &format!("pod-{pod}")])
            .args(["--spool-node-name", &format!("pod-{pod}")])
            // The pods' own network, as the chart allows its pod CIDR.
            .args(["--forward-allowed-peers", "10.79.0.0/16"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("ip netns exec binxd");
        let pod = Pod {
            child,
            binx,
            http,
            uds,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !(std::os::unix::net::UnixStream::connect(&pod.uds).is_ok()
            && std::net::TcpStream::connect(&pod.http).is_ok())
        {
            assert!(
                Instant::now() < deadline,
                "pod did not come up: {}",
                pod.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        pod
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.0.join("binxd.log")).unwrap_or_default()
    }

    fn engine(&self) -> Connection {
        Connection::new(
            Endpoint::Unix(self.uds.clone()),
            ConnectionOptions::default(),
        )
    }

    fn signal(&self, signal: &str) {
        crate::common::send_signal(&self.child, signal);
    }

    fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let log = self._dir.0.join("binxd.log");
        crate::common::wait_exit(&mut self.child, limit, &log)
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Pages of producer `from` for consumer `to`, seeded so either side can
/// make them.
fn pages_for(from: usize, to: usize, count: usize) -> Vec<Bytes> {
    let mut r = rng((from * 10 + to) as u64);
    (0..count)
        .map(|_| {
            let len = r.usize(1..=48 << 10);
            let mut page = vec![0u8; len];
            r.fill(&mut page);
            Bytes::from(page)
        })
        .collect()
}

fn digest(pages: &[Bytes]) -> [u8; 32] {
    let mut hash = Sha256::new();
    for page in pages {
        hash.update((page.len() as u64).to_be_bytes());
        hash.update(page);
    }
    hash.finalize().into()
}

/// Pod `from`'s engine produces task `task` with one buffer per pod, in
/// batches, pausing `pause` between them.
async fn produce(pod: &Pod, from: usize, task: &str, policy: &str, count: usize, pause: Duration) {
    let producer = binx_client::Producer::new(pod.engine());
    producer
        .open_task(
            task,
            &binx_client::TaskSpec {
                kind: BufferKind::Partitioned,
                buffer_count: PODS as u64,
                spool_policy: policy.into(),
            },
        )
        .await
        .unwrap();
    let all: Vec<Vec<Bytes>> = (0..PODS).map(|to| pages_for(from, to, count)).collect();
    for batch in 0..count.div_ceil(10) {
        for (to, pages) in all.iter().enumerate() {
            let chunk = &pages[batch * 10..((batch + 1) * 10).min(count)];
            producer.enqueue(task, to as u64, chunk).await.unwrap();
        }
        tokio::time::sleep(pause).await;
    }
    producer.no_more_pages(task, None).await.unwrap();
}

/// Pod `to`'s engine reads its buffer of `task` from pod `from`'s binxd,
/// through its own sidecar.
async fn consume(pod: &Pod, remote: &str, task: &str, to: usize) -> Vec<Bytes> {
    let mut source = ExchangeSource::new(
        pod.engine(),
        task,
        to as u64,
        SourceConfig {
            remote: Some(remote.to_string()),
            ..SourceConfig::default()
        },
    );
    let mut got = Vec::new();
    while let Some(page) = source.next_page().await.unwrap() {
        got.push(page.data);
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_to_all_exchange_survives_a_link_cut_of_5s() {
    let Some(network) = network_or_skip("all_to_all_exchange_survives_a_link_cut_of_5s") else {
        return;
    };
    let pods: Vec<Pod> = (0..PODS).map(|i| Pod::start(&network, i, &[])).collect();

    // First without faults: 9 streams, every page checked.
    all_to_all(&pods, 60, "calm", async { None }).await;

    // Again, with pod 1 cut off for 5 s while pages flow.
    let cut = async {
        tokio::time::sleep(Duration::from_millis(700)).await;
        network.link(1, false);
        tokio::time::sleep(Duration::from_secs(5)).await;
        network.link(1, true);
        Some((1, Instant::now()))
    };
    all_to_all(&pods, 60, "cut", cut).await;
    for pod in &pods {
        let stats = crate::common::stats_of(&pod.http, Some(SECRET));
        assert_eq!(stats["memory_used"], 0, "{stats}");
    }
}

/// Every pod produces task `<round>.<pod>` for every pod and reads its
/// buffer from every pod; `during` runs while the pages flow. Each of the 9
/// streams must equal what was produced, page for page.
async fn all_to_all<F>(pods: &[Pod], count: usize, round: &str, during: F)
where
    F: std::future::Future<Output = Option<(usize, Instant)>>,
{
    let tasks: Vec<String> = (0..pods.len())
        .map(|from| format!("{round}.{from}"))
        .collect();
    let mut producers = Vec::new();
    for (from, pod) in pods.iter().enumerate() {
        producers.push(produce(
            pod,
            from,
            &tasks[from],
            "off",
            count,
            Duration::from_millis(150),
        ));
    }
    let mut consumers = Vec::new();
    for (to, pod) in pods.iter().enumerate() {
        for (from, remote) in pods.iter().enumerate() {
            consumers.push(async move {
                let got = consume(pod, &remote.binx, &format!("{round}.{from}"), to).await;
                (from, to, got, Instant::now())
            });
        }
    }
    let (_, results, fault) = tokio::join!(
        futures_util::future::join_all(producers),
        futures_util::future::join_all(consumers),
        during
    );
    assert_eq!(results.len(), PODS * PODS);
    for (from, to, got, _) in &results {
        let want = pages_for(*from, *to, count);
        assert_eq!(got.len(), want.len(), "stream {from} -> {to}: page count");
        assert_eq!(digest(got), digest(&want), "stream {from} -> {to}: content");
    }
    // The fault hit pages in flight: a stream of the cut pod could only
    // finish once its link was back.
    if let Some((pod, back)) = fault {
        assert!(
            results
                .iter()
                .any(|(from, to, _, done)| (*from == pod || *to == pod) && *done > back),
            "every stream of pod {pod} had finished before its link came back"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_drains_its_pages_to_the_other_pods_before_it_stops() {
    let Some(network) =
        network_or_skip("a_sigterm_drains_its_pages_to_the_other_pods_before_it_stops")
    else {
        return;
    };
    let mut pods: Vec<Pod> = (0..PODS)
        .map(|i| Pod::start(&network, i, &["--drain-grace".into(), "60s".into()]))
        .collect();
    // Pod 0 produces everything before anyone reads.
    produce(&pods[0], 0, "drain.0", "off", 40, Duration::ZERO).await;
    pods[0].signal("TERM");
    // Readiness goes false at once; the pod still serves its pages.
    let deadline = Instant::now() + Duration::from_secs(5);
    while http_get(&pods[0].http, "/readyz").0 != 503 {
        assert!(Instant::now() < deadline, "readiness stayed true");
        std::thread::sleep(Duration::from_millis(20));
    }
    let remote = pods[0].binx.clone();
    let (got0, got1, got2) = tokio::join!(
        consume(&pods[0], &remote, "drain.0", 0),
        consume(&pods[1], &remote, "drain.0", 1),
        consume(&pods[2], &remote, "drain.0", 2),
    );
    for (to, got) in [got0, got1, got2].into_iter().enumerate() {
        assert_eq!(
            digest(&got),
            digest(&pages_for(0, to, 40)),
            "stream 0 -> {to}"
        );
    }
    // Everything consumed: it stops by itself.
    let status = pods[0].wait_exit(Duration::from_secs(15));
    assert!(status.success(), "{status:?}: {}", pods[0].log());
    assert!(pods[0].log().contains("drained"), "{}", pods[0].log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_finish_from_storage_after_an_always_producer_is_killed() {
    let Some(network) =
        network_or_skip("consumers_finish_from_storage_after_an_always_producer_is_killed")
    else {
        return;
    };
    let s3 = S3Server::start_on(&network.bridge_ip());
    let mut flags = s3.daemon_flags("netns");
    flags.extend(
        [
            "--spool-failover-after",
            "2s",
            "--spool-request-timeout",
            "5s",
        ]
        .map(String::from),
    );
    let mut pods: Vec<Pod> = (0..PODS).map(|i| Pod::start(&network, i, &flags)).collect();
    produce(&pods[0], 0, "always.0", "always", 30, Duration::ZERO).await;
    // Pod 1 reads part of its buffer before the producer dies.
    let remote = pods[0].binx.clone();
    let mut early = ExchangeSource::new(
        pods[1].engine(),
        "always.0",
        1,
        SourceConfig {
            remote: Some(remote.clone()),
            ..SourceConfig::default()
        },
    );
    let mut got1 = Vec::new();
    for _ in 0..10 {
        got1.push(early.next_page().await.unwrap().expect("a page").data);
    }
    pods[0].signal("KILL");
    pods[0].wait_exit(Duration::from_secs(5));
    while let Some(page) = early.next_page().await.unwrap() {
        got1.push(page.data);
    }
    assert_eq!(digest(&got1), digest(&pages_for(0, 1, 30)), "stream 0 -> 1");
    let got2 = consume(&pods[2], &remote, "always.0", 2).await;
    assert_eq!(digest(&got2), digest(&pages_for(0, 2, 30)), "stream 0 -> 2");
}
