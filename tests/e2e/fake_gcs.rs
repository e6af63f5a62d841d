//! fake-gcs-server, a Google Cloud Storage emulator, installed by
//! scripts/ensure-fake-gcs.sh and started by the test on a port of its own (`spawn_on_port`): the
//! GCS JSON API and path-style downloads, no mock of our own. binxd reaches
//! it through object_store's GCS client with a service-account file whose
//! `gcs_base_url` points at the emulator and whose RSA key (made by
//! openssl for the test) signs the URLs locally, as on real GCS.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use crate::common::{TempDir, ensure_tool, http_request, spawn_on_port};

pub(crate) struct FakeGcs {
    child: Child,
    pub url: String,
    addr: String,
    service_account: PathBuf,
    _dir: TempDir,
}

impl FakeGcs {
    /// Starts the emulator with the given buckets already there.
    pub(crate) fn start(buckets: &[&str]) -> FakeGcs {
        let bin = ensure_tool("ensure-fake-gcs.sh");
        let dir = TempDir::new("fake-gcs");
        let root = dir.0.join("root");
        for bucket in buckets {
            // The filesystem backend serves each folder of its root as a bucket.
            std::fs::create_dir_all(root.join(bucket)).expect("bucket folder");
        }
        let (child, port) = spawn_on_port("fake-gcs-server", |port| {
            let addr = format!("127.0.0.1:{port}");
            Command::new(&bin)
                .args(["-scheme", "http", "-host", "127.0.0.1"])
                .args(["-port", &port.to_string(), "-public-host", &addr])
                .args(["-backend", "filesystem", "-log-level", "warn"])
                .arg("-filesystem-root")
                .arg(&root)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("fake-gcs-server starts")
        });
        let addr = format!("127.0.0.1:{port}");
        let url = format!("http://{addr}");
        let key = dir.0.join("key.pem");
        let status = Command::new("openssl")
            .args([
                "genpkey",
                "-algorithm",
                "RSA",
                "-pkeyopt",
                "rsa_keygen_bits:2048",
            ])
            .arg("-out")
            .arg(&key)
            .stderr(Stdio::null())
            .status()
            .expect("openssl runs");
        assert!(status.success(), "openssl made no RSA key");
        let account = serde_json::json!({
            "type": "service_account",
            "private_key": std::fs::read_to_string(&key).expect("key"),
            "private_key_id": "binx-test",
            "client_email": "binx-test@binx.iam.gserviceaccount.com",
            "gcs_base_url": url,
        });
        let service_account = dir.0.join("service-account.json");
        std::fs::write(&service_account, account.to_string()).expect("service account file");
        FakeGcs {
            child,
            url,
            addr,
            service_account,
            _dir: dir,
        }
    }

    /// Environment that points object_store's GCS client at this emulator.
    pub(crate) fn env(&self) -> Vec<(String, String)> {
        vec![(
            "GOOGLE_SERVICE_ACCOUNT".into(),
            self.service_account.display().to_string(),
        )]
    }

    /// Names of the objects in `bucket`, through the JSON API.
    pub(crate) fn objects(&self, bucket: &str) -> Vec<String> {
        let response = http_request(&self.addr, "GET", &format!("/storage/v1/b/{bucket}/o"), &[]);
        assert_eq!(
            response.status,
            200,
            "{}",
            String::from_utf8_lossy(&response.body)
        );
        let list: serde_json::Value =
            serde_json::from_slice(&response.body).expect("an object listing");
        list["items"]
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .filter_map(|o| o["name"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for FakeGcs {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
