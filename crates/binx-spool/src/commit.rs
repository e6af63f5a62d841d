//! Commit markers (policy `always`): after NO_MORE_PAGES, a small JSON
//! object at `commit/<task>/<buffer>.json` lists the segment objects that
//! hold the buffer's pages and where the buffer ends. A consumer whose
//! producer is gone reads it and finishes the buffer from storage.
//!
//! Segment keys never appear in storage in the clear: a marker holds each
//! key wrapped (AES-256-GCM) under a key derived from the cluster's shared
//! secret, which every binxd of the cluster has and storage does not. With
//! no shared secret, encrypted segments cannot be listed in a marker.

use ring::aead::{Aad, Nonce};
use serde::{Deserialize, Serialize};

use crate::segment::{SegmentError, aes_key};

/// Where markers live, under a store's prefix.
pub const MARKER_DIR: &str = "commit/";

/// The marker path of a buffer, relative to the store prefix.
pub fn marker_path(task_id: &str, buffer_id: u64) -> String {
    format!("{MARKER_DIR}{task_id}/{buffer_id}.json")
}

/// The name of a task's commit manifest beside its markers.
const MANIFEST_NAME: &str = "task.json";

/// The manifest path of a task, relative to the store prefix.
pub fn manifest_path(task_id: &str) -> String {
    format!("{MARKER_DIR}{task_id}/{MANIFEST_NAME}")
}

/// Whether a listed name is a task's manifest rather than a buffer's marker.
pub fn is_manifest(name: &str) -> bool {
    name.ends_with(&format!("/{MANIFEST_NAME}"))
}

/// Whether a listed name is one binx writes under [`MARKER_DIR`]: a
/// buffer's marker, a task's manifest or a release record, of a valid task
/// id. The TTL pruner deletes only these: a store shared with other data
/// keeps what is not binx's, whatever its name.
pub fn is_commit_object(name: &str) -> bool {
    let Some((task, leaf)) = name
        .strip_prefix(MARKER_DIR)
        .and_then(|rest| rest.split_once('/'))
    else {
        return false;
    };
    if leaf.contains('/') || binx_core::validate_task_id(task).is_err() {
        return false;
    }
    leaf == MANIFEST_NAME
        || leaf.strip_suffix(".json").is_some_and(|buffer| {
            buffer.bytes().all(|b| b.is_ascii_digit()) && buffer.parse::<u64>().is_ok()
        })
        || release_record_of(name).is_some()
}

/// What a release record's name ends with.
const RELEASED_SUFFIX: &str = ".released";

/// The release record of a buffer whose marker is folded into its task's
/// manifest: an empty object a consumer writes once it finished the buffer
/// from storage (its producer gone), where it would delete a marker of the
/// buffer's own. The buffer's entry names nothing from then on; the last
/// release takes the manifest, then the records. Named after the process
/// (`instance`) whose manifest it releases, when that names one: a task id
/// opened again after a restart writes its manifest at the same path, and
/// the earlier run's records must not release the new run's buffers.
pub fn release_record_path(task_id: &str, buffer_id: u64, instance: Option<&str>) -> String {
    match instance {
        Some(instance) => format!("{MARKER_DIR}{task_id}/{buffer_id}.{instance}{RELEASED_SUFFIX}"),
        None => format!("{MARKER_DIR}{task_id}/{buffer_id}{RELEASED_SUFFIX}"),
    }
}

/// Whether a listed name is a release record: which buffer's, and the
/// process whose manifest it releases (`None`: one written before records
/// named it, which releases the buffer of any manifest).
pub fn release_record_of(name: &str) -> Option<(u64, Option<&str>)> {
    let stem = name.strip_suffix(RELEASED_SUFFIX)?.rsplit_once('/')?.1;
    match stem.split_once('.') {
        Some((buffer, instance)) if binx_proto::is_instance_id(instance) => {
            Some((buffer.parse().ok()?, Some(instance)))
        }
        Some(_) => None,
        None => Some((stem.parse().ok()?, None)),
    }
}

/// Whether a release record of process `record` (`None`: unnamed) releases
/// a buffer of the manifest that process `manifest` wrote.
pub fn releases(record: Option<&str>, manifest: Option<&str>) -> bool {
    record.is_none() || record == manifest
}

/// What a manifest's MAC covers before its JSON.
const MANIFEST_DOMAIN: &[u8] = b"binx manifest\0";

/// Largest commit manifest read back (65,536 buffers fit in far less).
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;

/// Longest node name or endpoint a manifest may give (a COMMITTED reply
/// carries both in its header, which must stay far within 64 KiB).
pub const MAX_MANIFEST_NAME: usize = 1024;

/// A task's commit manifest as stored (JSON), written after every marker of
/// a task-wide NO_MORE_PAGES: who serves the task, and where each buffer
/// ends and how many bytes it holds (index = buffer id). Format 2 carries
/// the buffers' markers too (`markers`), written with it instead of an
/// object each.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// Manifest format version: 1 without markers, 2 with them, 3 when
    /// one of them names a packed segment.
    pub format: u32,
    /// The task the manifest describes.
    pub task_id: String,
    /// The spool node name of the binxd that wrote it.
    pub node: String,
    /// The host:port other sidecars reach that binxd under.
    pub endpoint: String,
    /// The process instance (HELLO `instance=`) of the binxd that wrote
    /// it, for its folded markers (see `MarkerFile::instance`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// Per buffer: [end token, bytes].
    pub buffers: Vec<[u64; 2]>,
    /// Format 2: the markers of the buffers the manifest commits, by
    /// increasing buffer id (each ends where `buffers` says). Absent in
    /// format 1, whose markers are objects of their own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub markers: Vec<ManifestMarker>,
    /// As for markers: hex HMAC-SHA256 of the JSON without this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

/// A buffer's marker folded into its task's manifest (format 2): what a
/// marker object says, less what the manifest says already (task, node,
/// endpoint, end token). Never shared: only PARTITIONED tasks fold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestMarker {
    /// The committed buffer.
    pub buffer_id: u64,
    /// As a marker's `segments`.
    pub segments: Vec<MarkerSegment>,
}

/// A marker as stored (JSON): what it says about one buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkerFile {
    /// Marker format version: 1, or 2 when it names a packed segment.
    pub format: u32,
    /// The buffer's task.
    pub task_id: String,
    /// The finished buffer.
    pub buffer_id: u64,
    /// Token after the buffer's last page.
    pub end_token: u64,
    /// The spool node name of the binxd that wrote it: a proxy consumer
    /// serves it only for a remote that said it is that node.
    #[serde(default)]
    pub node: String,
    /// The host:port other sidecars reached it under.
    #[serde(default)]
    pub endpoint: String,
    /// The process instance (HELLO `instance=`, new at every start) of the
    /// binxd that wrote it: a sidecar that read the buffer from one process
    /// serves only that process's marker (a task id opened again after a
    /// restart writes its marker at the same path). Absent from markers of
    /// binxd before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// In token order; together they hold every page below `end_token`
    /// (objects of pages already acknowledged may be gone).
    pub segments: Vec<MarkerSegment>,
    /// Hex HMAC-SHA256 of the marker's JSON without this field, under a
    /// key derived from the cluster's shared secret: whoever can write to
    /// the bucket but does not know the secret cannot forge a marker.
    /// Absent when the cluster has no shared secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// The segments hold pages of other buffers too (BROADCAST); see
    /// `CommitMarker::shared`.
    #[serde(default)]
    pub shared: bool,
}

/// Largest commit marker read back.
pub const MAX_MARKER_BYTES: u64 = 64 << 20;

/// One segment object a marker lists.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkerSegment {
    /// Index of the object's store among the spool's stores.
    pub store: usize,
    /// The object's name within its store.
    pub name: String,
    /// Token of its first page.
    pub first_token: u64,
    /// Size of each page it holds, in token order (bytes).
    pub page_sizes: Vec<u64>,
    /// Size of the object as stored (bytes, after compression and sealing).
    pub stored_size: u64,
    /// Hex of nonce, wrapped key and tag; `null` when not encrypted.
    pub wrapped_key: Option<String>,
}

/// The keys derived from the shared secret for commit markers: one wraps
/// segment keys, one authenticates the marker itself.
#[derive(Clone)]
pub struct KeyWrap {
    kek: [u8; 32],
    mac: [u8; 32],
}

impl std::fmt::Debug for KeyWrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyWrap(hidden)")
    }
}

impl KeyWrap {
    /// Derives both keys from the cluster's shared secret (SHA-256 of the
    /// secret under a label of each key's own).
    pub fn from_secret(secret: &str) -> KeyWrap {
        let digest = ring::digest::digest(
            &ring::digest::SHA256,
            &[b"binx spool key wrap v1\0".as_slice(), secret.as_bytes()].concat(),
        );
        let mut kek = [0u8; 32];
        kek.copy_from_slice(digest.as_ref());
        let digest = ring::digest::digest(
            &ring::digest::SHA256,
            &[b"binx commit marker mac v1\0".as_slice(), secret.as_bytes()].concat(),
        );
        let mut mac = [0u8; 32];
        mac.copy_from_slice(digest.as_ref());
        KeyWrap { kek, mac }
    }

    /// Sets the marker's `mac`: HMAC-SHA256 of its JSON without it.
    pub fn sign(&self, marker: &mut MarkerFile) {
        marker.mac = None;
        marker.mac = serde_json::to_vec(&marker)
            .ok()
            .map(|json| hex(self.tag(&[&json]).as_ref()));
    }

    /// Sets the manifest's `mac`: HMAC-SHA256 of its JSON without it, in a
    /// domain of its own, so a marker's MAC can never pass for one.
    pub fn sign_manifest(&self, manifest: &mut ManifestFile) {
        manifest.mac = None;
        manifest.mac = serde_json::to_vec(&manifest)
            .ok()
            .map(|json| hex(self.tag(&[MANIFEST_DOMAIN, &json]).as_ref()));
    }

    /// Whether `stored`, a marker's JSON as read back, is one this secret
    /// signed. Checked on the bytes, before anything of them is parsed: a
    /// forged marker costs a hash of its bytes, never the memory of its
    /// parse.
    pub fn signed_marker(&self, stored: &[u8]) -> bool {
        self.signed(b"", stored)
    }

    /// As [`KeyWrap::signed_marker`], for a manifest's JSON.
    pub fn signed_manifest(&self, stored: &[u8]) -> bool {
        self.signed(MANIFEST_DOMAIN, stored)
    }

    /// binxd writes the MAC as the JSON's one `,"mac":"<64 hex>"` member
    /// (serde_json, fields in declaration order), so the signed JSON is
    /// the stored bytes around it. The member cannot appear inside a
    /// string: JSON escapes a quote there.
    fn signed(&self, domain: &[u8], stored: &[u8]) -> bool {
        const MEMBER: &[u8] = b",\"mac\":\"";
        let find = |bytes: &[u8]| bytes.windows(MEMBER.len()).position(|w| w == MEMBER);
        let Some(at) = find(stored) else {
            return false;
        };
        let hex_at = at + MEMBER.len();
        let (Some(digits), Some(b'"')) = (stored.get(hex_at..hex_at + 64), stored.get(hex_at + 64))
        else {
            return false;
        };
        let rest = &stored[hex_at + 65..];
        let Some(given) = std::str::from_utf8(digits).ok().and_then(unhex) else {
            return false;
        };
        if find(rest).is_some() {
            return false;
        }
        let tag = self.tag(&[domain, &stored[..at], rest]);
        // In constant time, as ring::hmac::verify compares.
        tag.as_ref().len() == given.len()
            && tag
                .as_ref()
                .iter()
                .zip(&given)
                .fold(0u8, |d, (a, b)| d | (a ^ b))
                == 0
    }

    /// HMAC-SHA256 of the pieces, one after the other.
    fn tag(&self, pieces: &[&[u8]]) -> ring::hmac::Tag {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &self.mac);
        let mut context = ring::hmac::Context::with_key(&key);
        for piece in pieces {
            context.update(piece);
        }
        context.sign()
    }

    /// Seals a segment key for a marker: hex of a random nonce, the
    /// encrypted key and its tag.
    pub fn wrap(&self, key: &[u8; 32]) -> Result<String, SegmentError> {
        let mut nonce = [0u8; 12];
        getrandom::fill(&mut nonce)
            .map_err(|e| SegmentError::Encode(format!("no randomness for a nonce: {e}")))?;
        let mut sealed = key.to_vec();
        aes_key(&self.kek)?
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::empty(),
                &mut sealed,
            )
            .map_err(|_| SegmentError::Encode("key wrap failed".into()))?;
        Ok(hex(&[nonce.as_slice(), &sealed].concat()))
    }

    /// The key, or `None` when the text is not one this secret wrapped.
    pub fn unwrap(&self, wrapped: &str) -> Option<[u8; 32]> {
        let bytes = unhex(wrapped)?;
        let (nonce, sealed) = bytes.split_at_checked(12)?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut buffer = sealed.to_vec();
        let key = aes_key(&self.kek)
            .ok()?
            .open_in_place(nonce, Aad::empty(), &mut buffer)
            .ok()?;
        key.try_into().ok()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapped_keys_open_only_with_the_same_secret() {
        let key = [7u8; 32];
        let wrap = KeyWrap::from_secret("cluster secret");
        let wrapped = wrap.wrap(&key).unwrap();
        assert!(!wrapped.contains(&hex(&key)));
        assert_eq!(wrap.unwrap(&wrapped), Some(key));
        assert_eq!(KeyWrap::from_secret("other").unwrap(&wrapped), None);
        let mut flipped = wrapped.clone().into_bytes();
        flipped[30] = if flipped[30] == b'0' { b'1' } else { b'0' };
        assert_eq!(wrap.unwrap(&String::from_utf8(flipped).unwrap()), None);
        assert_eq!(wrap.unwrap("zz"), None);
    }

    #[test]
    fn only_names_binx_writes_are_commit_objects() {
        let ours = [
            marker_path("q1.s2:t3", 4),
            manifest_path("q1.s2:t3"),
            release_record_path("q1", 7, None),
            release_record_path("q1", 7, Some("0123456789abcdef")),
        ];
        for name in &ours {
            assert!(is_commit_object(name), "{name}");
        }
        let theirs = [
            "commit/readme.txt",
            "commit/q1/notes.txt",
            "commit/q1/+4.json",
            "commit/q1/.json",
            "commit/q1/4.json.bak",
            "commit/q1/sub/4.json",
            "commit/../4.json",
            "commit/a b/4.json",
            "commit/q1/7.x y.released",
            "other/q1/4.json",
            "commit/",
        ];
        for name in theirs {
            assert!(!is_commit_object(name), "{name}");
        }
    }

    #[test]
    fn marker_paths_and_json_round_trip() {
        assert_eq!(marker_path("q1.s2:t3", 4), "commit/q1.s2:t3/4.json");
        let marker = MarkerFile {
            format: 1,
            task_id: "t".into(),
            buffer_id: 2,
            end_token: 10,
            node: "pod-1".into(),
            endpoint: "10.0.0.1:8091".into(),
            instance: None,
            segments: vec![MarkerSegment {
                store: 0,
                name: "x.bxs".into(),
                first_token: 0,
                page_sizes: vec![1, 2],
                stored_size: 40,
                wrapped_key: None,
            }],
            mac: None,
            shared: false,
        };
        let text = serde_json::to_string(&marker).unwrap();
        assert!(!text.contains("mac"), "{text}");
        assert_eq!(serde_json::from_str::<MarkerFile>(&text).unwrap(), marker);
    }

    #[test]
    fn markers_are_authenticated_by_the_secret() {
        let wrap = KeyWrap::from_secret("cluster secret");
        let mut marker = MarkerFile {
            format: 1,
            task_id: "t \",\"mac\":\"".into(),
            buffer_id: 0,
            end_token: 3,
            node: "pod-1".into(),
            endpoint: "10.0.0.1:8091".into(),
            instance: None,
            segments: Vec::new(),
            mac: None,
            shared: false,
        };
        let unsigned = serde_json::to_vec(&marker).unwrap();
        assert!(!wrap.signed_marker(&unsigned), "unsigned");
        wrap.sign(&mut marker);
        let stored = serde_json::to_vec(&marker).unwrap();
        assert!(wrap.signed_marker(&stored));
        // Signing again gives the same MAC (a set one is not signed over).
        let mut again = marker.clone();
        wrap.sign(&mut again);
        assert_eq!(again, marker);
        assert!(!KeyWrap::from_secret("other").signed_marker(&stored));
        assert!(
            !wrap.signed_manifest(&stored),
            "a marker's MAC is no manifest's"
        );
        let text = String::from_utf8(stored.clone()).unwrap();
        let changed = |from: &str, to: &str| text.replacen(from, to, 1).into_bytes();
        for (what, forged) in [
            ("end token", changed("\"end_token\":3", "\"end_token\":2")),
            (
                "a member added",
                changed("\"shared\":false", "\"shared\":false,\"x\":1"),
            ),
            ("spaces", changed("\"shared\":false", "\"shared\": false")),
            (
                "mac twice",
                changed(
                    "\"shared\"",
                    &format!("\"mac\":\"{}\",\"shared\"", marker.mac.as_deref().unwrap()),
                ),
            ),
            (
                "mac cut",
                changed(&marker.mac.as_deref().unwrap()[60..], "\""),
            ),
            (
                "mac not hex",
                changed(&marker.mac.as_deref().unwrap()[..2], "zz"),
            ),
        ] {
            assert!(
                !wrap.signed_marker(&forged),
                "{what}: {}",
                String::from_utf8_lossy(&forged)
            );
        }
        let mut manifest = ManifestFile {
            format: 1,
            task_id: "t".into(),
            node: "pod-1".into(),
            endpoint: "10.0.0.1:8091".into(),
            instance: None,
            buffers: vec![[3, 40]],
            markers: Vec::new(),
            mac: None,
        };
        wrap.sign_manifest(&mut manifest);
        let stored = serde_json::to_vec(&manifest).unwrap();
        assert!(wrap.signed_manifest(&stored));
        assert!(
            !wrap.signed_marker(&stored),
            "a manifest's MAC is no marker's"
        );
    }
}
