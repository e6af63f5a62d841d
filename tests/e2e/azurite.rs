//! Azurite, Microsoft's Azure Storage emulator, installed by
//! scripts/ensure-azurite.sh and started by the test on a port of its own (`spawn_on_port`): the
//! real Azure Blob protocol (SharedKey auth, SAS URLs), no mock of our own.

use std::process::{Child, Command, Stdio};

use crate::common::{TempDir, ensure_tool, spawn_on_port};

/// Azurite's well-known development account.
pub(crate) const ACCOUNT: &str = "devstoreaccount1";
const KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

pub(crate) struct Azurite {
    child: Child,
    pub url: String,
    _dir: TempDir,
}

impl Azurite {
    pub(crate) fn start() -> Azurite {
        let bin = ensure_tool("ensure-azurite.sh");
        let dir = TempDir::new("azurite");
        let (child, port) = spawn_on_port("azurite", |port| {
            Command::new(&bin)
                .args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
                .arg("--location")
                .arg(&dir.0)
                .args(["--silent", "--skipApiVersionCheck"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("azurite starts")
        });
        let url = format!("http://127.0.0.1:{port}");
        Azurite {
            child,
            url,
            _dir: dir,
        }
    }

    /// Environment that points object_store's Azure client at this emulator.
    pub(crate) fn env(&self) -> Vec<(String, String)> {
        vec![
            ("AZURE_STORAGE_USE_EMULATOR".into(), "true".into()),
            ("AZURITE_BLOB_STORAGE_URL".into(), self.url.clone()),
        ]
    }

    /// Creates a container (object stores cannot), signed with SharedKey
    /// by a few lines of Node.js; returns its blob names with `list`.
    pub(crate) fn create_container(&self, name: &str) {
        self.node(&format!(
            "{SIGN} request('PUT', '{name}', 'restype=container', (s, b) => {{ if (s !== 201) {{ console.error(s, b); process.exit(1); }} }});"
        ));
    }

    /// Names of the blobs in `container`.
    pub(crate) fn blobs(&self, container: &str) -> Vec<String> {
        let out = self.node(&format!(
            "{SIGN} request('GET', '{container}', 'comp=list&restype=container', (s, b) => {{ if (s !== 200) {{ console.error(s, b); process.exit(1); }} for (const m of b.matchAll(/<Name>([^<]*)<\\/Name>/g)) console.log(m[1]); }});"
        ));
        out.lines().map(str::to_string).collect()
    }

    fn node(&self, script: &str) -> String {
        let out = Command::new("node")
            .arg("-e")
            .arg(script)
            .env("AZURITE_URL", &self.url)
            .env("AZURITE_ACCOUNT", ACCOUNT)
            .env("AZURITE_KEY", KEY)
            .output()
            .expect("node runs");
        assert!(
            out.status.success(),
            "node: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// SharedKey signing of a request without a body (Azure Storage REST,
/// version 2021-08-06), path-style as the emulator is addressed.
const SIGN: &str = r#"
const crypto = require('crypto'), http = require('http');
const base = new URL(process.env.AZURITE_URL), account = process.env.AZURITE_ACCOUNT;
function request(verb, container, query, done) {
  const date = new Date().toUTCString(), version = '2021-08-06';
  const params = new URLSearchParams(query);
  const canonicalQuery = [...params.keys()].sort().map(k => `\n${k}:${params.get(k)}`).join('');
  const toSign = `${verb}\n\n\n\n\n\n\n\n\n\n\n\nx-ms-date:${date}\nx-ms-version:${version}\n/${account}/${account}/${container}${canonicalQuery}`;
  const signature = crypto.createHmac('sha256', Buffer.from(process.env.AZURITE_KEY, 'base64')).update(toSign, 'utf8').digest('base64');
  const req = http.request({ host: base.hostname, port: base.port, method: verb,
      path: `/${account}/${container}?${query}`,
      headers: { 'x-ms-date': date, 'x-ms-version': version, 'Content-Length': 0,
                 'Authorization': `SharedKey ${account}:${signature}` } }, res => {
    let body = ''; res.on('data', c => body += c); res.on('end', () => done(res.statusCode, body));
  });
  req.end();
}
"#;

impl Drop for Azurite {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
