//! The spool over a `memory://` and a `file://` store at once: tasks are
//! spread over both, objects read back exactly, released objects are
//! deleted, and expired ones pruned.

use std::time::{Duration, SystemTime};

use binx_core::{ManifestPlan, MarkerPlan, ObjectMeta, TaskId};
use binx_spool::{Codec, Durability, Encryption, PackedName, Spool, SpoolConfig, object_of};
use bytes::Bytes;

/// An empty directory of this test process, named after `name`.
fn fresh_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("binx-spool-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A segment of one page written for `task` (at token 0).
async fn one_page(spool: &Spool, task: &str) -> ObjectMeta {
    spool
        .write(
            task,
            0,
            vec![Bytes::from_static(b"page")],
            Durability::Overflow,
        )
        .await
        .expect("segment")
}

/// The first token and pages of a `file://` store's `object`, read from its
/// file, whose size must be the object's stored size (for a packed one,
/// from its range of its pack's file).
fn read_local(dir: &std::path::Path, object: &ObjectMeta, case: &str) -> (u64, Vec<Bytes>) {
    let bytes = match PackedName::parse(&object.name) {
        Some(packed) => {
            let pack = std::fs::read(dir.join(packed.pack)).expect("the pack is a file");
            let start = usize::try_from(packed.offset).expect("offset");
            let end = start + usize::try_from(object.stored_size).expect("size");
            assert!(end <= pack.len(), "{case}: the range lies in the pack");
            pack[start..end].to_vec()
        }
        None => std::fs::read(dir.join(&object.name)).expect("the object is a file"),
    };
    assert_eq!(bytes.len() as u64, object.stored_size, "{case}");
    binx_spool::decode_segment(
        &object.name,
        &bytes,
        object.key.as_ref(),
        Default::default(),
    )
    .unwrap_or_else(|e| panic!("{case}: {e}"))
}

/// The commit marker of `buffer` of `task` read back, which must be there
/// (`what` names it in the failure).
async fn marker_of(spool: &Spool, task: &str, buffer: u64, what: &str) -> binx_core::CommitMarker {
    spool
        .read_marker(task, buffer)
        .await
        .expect("read")
        .unwrap_or_else(|| panic!("no {what}"))
}

/// The names of the entries of directory `dir`, sorted (none when it is
/// not there).
fn sorted_names(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// A spool over one `file://` store in `dir`, encrypting or not.
fn file_spool(dir: &std::path::Path, encryption: Encryption) -> std::sync::Arc<Spool> {
    Spool::open(SpoolConfig {
        stores: vec![format!("file://{}", dir.display())],
        node_name: "unit".into(),
        encryption,
        ..SpoolConfig::default()
    })
    .expect("open")
}

/// Puts a file where the store `dir` was: nothing can be written there.
fn make_unwritable(dir: &std::path::Path) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::write(dir, b"not a directory").expect("a file where the store was");
}

/// A spool over one `file://` store in a fresh directory, with defaults.
fn local_spool(name: &str) -> (std::path::PathBuf, std::sync::Arc<Spool>) {
    let dir = fresh_dir(name);
    let spool = Spool::open(SpoolConfig {
        stores: vec![format!("file://{}", dir.display())],
        node_name: "unit".into(),
        ..SpoolConfig::default()
    })
    .expect("open");
    (dir, spool)
}

/// The commit marker of buffer `buffer` of `task`, ending at `end_token`,
/// naming `objects` (not shared).
fn marker_plan(task: &str, buffer: u64, end_token: u64, objects: &[&ObjectMeta]) -> MarkerPlan {
    MarkerPlan {
        task: TaskId::parse(task).unwrap(),
        buffer,
        end_token,
        objects: objects
            .iter()
            .map(|o| std::sync::Arc::new((*o).clone()))
            .collect(),
        shared: false,
    }
}

/// A spool over `dir` in a cluster whose shared secret signs markers and
/// manifests.
fn signed_spool(dir: &std::path::Path) -> std::sync::Arc<Spool> {
    Spool::open(SpoolConfig {
        stores: vec![format!("file://{}", dir.display())],
        node_name: "unit".into(),
        key_wrap: Some(binx_spool::KeyWrap::from_secret("cluster secret")),
        ..SpoolConfig::default()
    })
    .expect("open")
}

/// The JSON file at `path`.
fn json_at(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).expect("read")).expect("JSON")
}

/// `honest` with `change` made to it, as bytes.
fn altered(honest: &serde_json::Value, change: &dyn Fn(&mut serde_json::Value)) -> Vec<u8> {
    let mut v = honest.clone();
    change(&mut v);
    serde_json::to_vec(&v).expect("JSON")
}

/// A file read back refused as `what` should be: for good (asking again
/// gets the same), saying `says`, and naming `file`.
fn assert_refused(e: &binx_spool::SpoolError, what: &str, says: &str, file: &str) {
    assert!(!e.is_transient(), "{what}: {e}");
    let text = e.to_string();
    assert!(text.contains(says), "{what}: {text}");
    assert!(text.contains(file), "{what} names the file: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stores_share_the_tasks_and_lose_nothing() {
    let dir = fresh_dir("stores");
    let spool = Spool::open(SpoolConfig {
        stores: vec!["memory://".into(), format!("file://{}", dir.display())],
        node_name: "unit".into(),
        codec: Codec::Lz4,
        encryption: Encryption::Auto,
        ..SpoolConfig::default()
    })
    .expect("open");
    let mut used = [0usize; 2];
    let mut objects = Vec::new();
    for t in 0..16u8 {
        let task = format!("task-{t}");
        let pages: Vec<Bytes> = (0..5u8)
            .map(|i| Bytes::from(vec![i ^ t; 1000 + usize::from(i)]))
            .collect();
        let object = spool
            .write(&task, 7, pages.clone(), Durability::Overflow)
            .await
            .expect("write");
        assert_eq!(
            object.key, None,
            "memory and file stores are not encrypted by default"
        );
        used[object.store] += 1;
        let read = spool.read(&object).await.expect("read back");
        assert_eq!(*read, pages);
        objects.push(object);
    }
    assert!(
        used[0] > 0 && used[1] > 0,
        "tasks spread over both stores: {used:?}"
    );
    let files = || std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0);
    assert_eq!(files(), used[1]);

    // Released: every object goes.
    for object in &objects {
        spool.delete(object).await.expect("delete");
    }
    assert_eq!(spool.stats().objects_deleted, 16);
    assert_eq!(files(), 0);
    for store in spool.stores() {
        assert!(
            store.list().await.expect("list").is_empty(),
            "{}",
            store.url()
        );
    }

    // Durable objects outlive a restart prune, and go once expired.
    let mut kept = Vec::new();
    for t in 0..4 {
        let task = format!("task-{t}");
        let one = vec![Bytes::from_static(b"x")];
        kept.push(
            spool
                .write(&task, 0, one, Durability::Durable)
                .await
                .expect("write"),
        );
    }
    assert_eq!(spool.prune(SystemTime::now(), true).await, 0);
    // Other files under the commit directory (a store shared with other
    // data) are not binx's: never pruned, however old.
    let foreign = [
        dir.join("commit").join("readme.txt"),
        dir.join("commit").join("task-0").join("notes.txt"),
    ];
    for path in &foreign {
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
        std::fs::write(path, b"not binx's").expect("write");
    }
    let later = SystemTime::now() + Duration::from_secs(13 * 3600);
    assert_eq!(spool.prune(later, false).await, 4);
    assert_eq!(spool.stats().objects_pruned, 4);
    for path in &foreign {
        assert!(path.exists(), "{} was pruned", path.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `file://` objects are written by binx-spool itself (one `writev`, the CRC
/// beside it), not by object_store: each codec, with and without
/// encryption, gives a file that an independent decoder reads back exactly,
/// with the declared size, and no staging file is left behind. The pages
/// (about 2.9 MiB) span three format 2 chunks, which an encrypted segment
/// seals on one thread while another writes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_files_are_whole_segments_for_every_codec() {
    let dir = fresh_dir("local");
    let pages: Vec<Bytes> = (0..90u32)
        .map(|i| {
            let len = 1 + (i as usize * 7919) % (64 << 10);
            Bytes::from((0..len).map(|j| (j as u32 ^ i) as u8).collect::<Vec<_>>())
        })
        .collect();
    for codec in [Codec::None, Codec::Lz4, Codec::Zstd] {
        for encryption in [Encryption::Off, Encryption::On] {
            let case = format!("{codec:?}/{encryption:?}");
            let spool = Spool::open(SpoolConfig {
                stores: vec![format!("file://{}", dir.display())],
                node_name: "unit".into(),
                codec,
                encryption,
                ..SpoolConfig::default()
            })
            .expect("open");
            let object = spool
                .write("task-a", 11, pages.clone(), Durability::Overflow)
                .await
                .expect("write");
            assert_eq!(object.key.is_some(), encryption == Encryption::On, "{case}");
            let (first, read) = read_local(&dir, &object, &case);
            assert_eq!((first, &read), (11, &pages), "{case}");
            let names: Vec<String> = std::fs::read_dir(&dir)
                .expect("dir")
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .collect();
            assert_eq!(names, vec![object.name.clone()], "{case}: no staging file");
            spool.delete(&object).await.expect("delete");
            assert!(
                std::fs::read_dir(&dir).expect("dir").next().is_none(),
                "{case}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A read-ahead puts an object in the read cache, so the DATA that needs it
/// does not read it again; one running beside that DATA's read does not read
/// it twice; one of an object already gone is only logged (no error
/// counted), while the read that needs it reports the loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_ahead_fills_the_cache_once_and_a_failed_one_counts_nothing() {
    let (dir, spool) = local_spool("ahead");
    let pages: Vec<Bytes> = (0..4u8).map(|i| Bytes::from(vec![i; 300_000])).collect();
    let first = spool
        .write("task-a", 0, pages.clone(), Durability::Overflow)
        .await
        .expect("write");
    let second = spool
        .write("task-a", 4, pages.clone(), Durability::Overflow)
        .await
        .expect("write");
    spool.read_ahead(&first).await;
    assert_eq!(
        (spool.stats().objects_read, spool.stats().objects_read_ahead),
        (1, 1)
    );
    assert_eq!(*spool.read(&first).await.expect("read"), pages);
    assert_eq!(spool.stats().objects_read, 1, "served from the cache");
    // A read-ahead and a read of the same object at once: one load.
    let (_, read) = tokio::join!(spool.read_ahead(&second), spool.read(&second));
    assert_eq!(*read.expect("read"), pages);
    assert_eq!(spool.stats().objects_read, 2);
    // Gone before its read-ahead: nothing counted; the read says so.
    let third = spool
        .write("task-a", 8, pages.clone(), Durability::Overflow)
        .await
        .expect("write");
    std::fs::remove_file(dir.join(&third.name)).expect("remove");
    spool.read_ahead(&third).await;
    assert_eq!(spool.stats().errors, 0);
    let err = spool.read(&third).await.expect_err("the object is gone");
    assert!(err.to_string().contains(&third.name), "{err}");
    assert_eq!(spool.stats().errors, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Replies reading storage reserve room in the read budget and give it back
/// when their body is dropped; with no room left a reservation waits, then
/// fails; a read-ahead without room is skipped. `read_bytes_held` shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_read_budget_holds_until_the_reply_body_is_dropped() {
    let dir = fresh_dir("budget");
    let spool = Spool::open(SpoolConfig {
        stores: vec![format!("file://{}", dir.display())],
        node_name: "unit".into(),
        read_cache_bytes: 4 << 20,
        read_budget_bytes: 1 << 20,
        ..SpoolConfig::default()
    })
    .expect("open");
    let wait = Duration::from_millis(100);
    assert_eq!(spool.stats().read_bytes_held, 0);
    // A reply larger than the budget takes all of it.
    let big = spool.reserve_reading(5 << 20, wait).await.expect("room");
    assert_eq!(spool.stats().read_bytes_held, 1 << 20);
    assert!(
        spool.reserve_reading(1, wait).await.is_none(),
        "no room left"
    );
    let mut body = vec![
        Bytes::from_static(b"page one"),
        Bytes::from(vec![7u8; 1000]),
    ];
    big.hold_with(&mut body);
    assert_eq!(
        body[1],
        Bytes::from(vec![7u8; 1000]),
        "the body is unchanged"
    );
    // A read-ahead finds no room: skipped, nothing read.
    let pages: Vec<Bytes> = (0..2u8).map(|i| Bytes::from(vec![i; 1000])).collect();
    let object = spool
        .write("task-b", 0, pages.clone(), Durability::Overflow)
        .await
        .expect("write");
    spool.read_ahead(&object).await;
    assert_eq!(spool.stats().objects_read_ahead, 0);
    // Held while the body lives, given back when the body goes.
    let waiting = spool.reserve_reading(512 << 10, Duration::from_secs(10));
    let (reserved, ()) = tokio::join!(waiting, async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(body);
    });
    let half = reserved.expect("room once the body was dropped");
    assert_eq!(spool.stats().read_bytes_held, 512 << 10);
    // An empty body gives it back at once.
    half.hold_with(&mut []);
    assert_eq!(spool.stats().read_bytes_held, 0);
    spool.read_ahead(&object).await;
    assert_eq!(spool.stats().objects_read_ahead, 1);
    assert_eq!(spool.stats().read_bytes_held, 2000, "the cache holds it");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A local segment that cannot be written (its directory is gone, a file
/// stands in its place) is an error naming the object, for the sealing
/// writer (encrypted) as for the plain one; nothing hangs and nothing is
/// left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_segment_that_cannot_be_written_is_an_error() {
    let dir = fresh_dir("unwritable");
    let pages: Vec<Bytes> = (0..8u8).map(|i| Bytes::from(vec![i; 700_000])).collect();
    for encryption in [Encryption::Off, Encryption::On] {
        let spool = file_spool(&dir, encryption);
        make_unwritable(&dir);
        let err = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            spool.write("task-a", 0, pages.clone(), Durability::Overflow),
        )
        .await
        .expect("the write ends")
        .expect_err("the write fails");
        let text = err.to_string();
        assert!(text.contains("cannot write"), "{encryption:?}: {text}");
        assert_eq!(
            std::fs::read(&dir).expect("the file is still there"),
            b"not a directory"
        );
        std::fs::remove_file(&dir).expect("remove");
    }
}

/// Many segments at once (a commit's, one a buffer): each comes back as
/// the object `Spool::write` would have made of it, in the order asked,
/// small and large, framed only or sealed, each a whole segment file and
/// no staging file left; written in jobs of at most 4 MiB, the counters
/// count each once; into a store that cannot be written, each fails
/// alone, named, and nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segments_written_together_are_each_what_one_write_makes() {
    let dir = fresh_dir("together");
    // 300 small segments (past one job's 128 files and 4 MiB), two of 3 MiB
    // (each beyond a small one's size), and one empty page.
    let mut writes: Vec<(String, u64, Vec<Bytes>)> = (0..300u32)
        .map(|i| {
            let len = 1 + (i as usize * 7919) % (40 << 10);
            let page = Bytes::from((0..len).map(|j| (j as u32 ^ i) as u8).collect::<Vec<_>>());
            (
                format!("task-{}", i % 7),
                u64::from(i) * 3,
                vec![page.clone(), page],
            )
        })
        .collect();
    writes.insert(
        17,
        ("task-big".into(), 5, vec![Bytes::from(vec![7u8; 3 << 20])]),
    );
    writes.insert(
        200,
        ("task-big".into(), 6, vec![Bytes::from(vec![9u8; 3 << 20])]),
    );
    writes.insert(90, ("task-empty".into(), 0, vec![Bytes::new()]));
    for (encryption, pack) in [
        (Encryption::Off, false),
        (Encryption::Off, true),
        (Encryption::On, true),
    ] {
        let case = format!("{encryption:?}, packing {pack}");
        let spool = Spool::open(SpoolConfig {
            stores: vec![format!("file://{}", dir.display())],
            node_name: "unit".into(),
            encryption,
            pack_segments: pack,
            ..SpoolConfig::default()
        })
        .expect("open");
        assert_eq!(
            spool.writes_together("task-a", 1 << 20),
            encryption == Encryption::Off,
            "{case}: small framed-only segments of a local store go together"
        );
        assert!(!spool.writes_together("task-a", (1 << 20) + 1), "{case}");
        let asked = |writes: &[(String, u64, Vec<Bytes>)]| -> Vec<binx_spool::SegmentWrite> {
            writes
                .iter()
                .map(|(task, first_token, pages)| binx_spool::SegmentWrite {
                    task: task.clone(),
                    first_token: *first_token,
                    pages: pages.clone(),
                    durability: Durability::Durable,
                    // One in five may not be packed (not a commit's).
                    pack: first_token % 5 != 0,
                })
                .collect()
        };
        let before = spool.stats();
        let written = spool.write_segments(asked(&writes)).await;
        assert_eq!(written.len(), writes.len(), "{case}");
        let mut names = std::collections::BTreeSet::new();
        for ((_, first_token, pages), object) in writes.iter().zip(&written) {
            let object = object.as_ref().unwrap_or_else(|e| panic!("{case}: {e}"));
            if first_token % 5 == 0 {
                assert_eq!(
                    PackedName::parse(&object.name),
                    None,
                    "{case}: not to be packed"
                );
            }
            assert_eq!(object.first_token, *first_token, "{case}");
            let sizes: Vec<u64> = pages.iter().map(|p| p.len() as u64).collect();
            assert_eq!(object.page_sizes, sizes, "{case}");
            assert_eq!(object.key.is_some(), encryption == Encryption::On, "{case}");
            let (first, read) = read_local(&dir, object, &case);
            assert_eq!((first, &read), (*first_token, pages), "{case}");
            assert!(
                names.insert(object.name.clone()),
                "{case}: a name given twice"
            );
        }
        let on_disk = || -> std::collections::BTreeSet<String> {
            std::fs::read_dir(&dir)
                .expect("dir")
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .collect()
        };
        let files: std::collections::BTreeSet<String> =
            names.iter().map(|n| object_of(n).to_string()).collect();
        assert_eq!(
            on_disk(),
            files,
            "{case}: every object (or its pack), and no staging file"
        );
        let packed = names
            .iter()
            .filter(|n| PackedName::parse(n).is_some())
            .count();
        // 7 tasks of about 43 small segments, 20 KiB each on average: a
        // pack holds at most 4 MiB, so each task's go in one or a few.
        if pack && encryption == Encryption::Off {
            assert_eq!(
                packed, 240,
                "{case}: every small one that may be, of a task with several"
            );
            let packs: std::collections::BTreeSet<&str> = names
                .iter()
                .filter(|n| PackedName::parse(n).is_some())
                .map(|n| object_of(n))
                .collect();
            assert!((7..=14).contains(&packs.len()), "{case}: {packs:?}");
            assert_eq!(
                files.len(),
                writes.len() - packed + packs.len(),
                "{case}: a file a pack, and one each for the others"
            );
        } else {
            assert_eq!(packed, 0, "{case}");
            assert_eq!(files.len(), writes.len(), "{case}");
        }
        let after = spool.stats();
        assert_eq!(
            after.objects_packed - before.objects_packed,
            packed as u64,
            "{case}"
        );
        assert_eq!(
            after.objects_spooled - before.objects_spooled,
            writes.len() as u64,
            "{case}"
        );
        let page_bytes: u64 = writes
            .iter()
            .flat_map(|w| &w.2)
            .map(|p| p.len() as u64)
            .sum();
        assert_eq!(
            after.bytes_spooled - before.bytes_spooled,
            page_bytes,
            "{case}"
        );
        assert_eq!(after.errors, before.errors, "{case}");
        // Half deleted, in an order unlike the packs': the other half
        // still reads back exactly through the spool; then none is left.
        let mut written: Vec<ObjectMeta> = written.into_iter().flatten().collect();
        let kept = written.split_off(written.len() / 2);
        for object in written.iter().rev() {
            spool.delete(object).await.expect("delete");
        }
        for object in &kept {
            let pages = spool
                .read(object)
                .await
                .unwrap_or_else(|e| panic!("{case}: {e}"));
            let (_, want) = read_local(&dir, object, &case);
            assert_eq!(*pages, want, "{case}: {}", object.name);
        }
        for object in &kept {
            spool.delete(object).await.expect("delete");
        }
        assert_eq!(
            on_disk(),
            Default::default(),
            "{case}: the last segment of a pack took it"
        );
        // Into a store that cannot be written: each fails, named, alone.
        make_unwritable(&dir);
        let errors_before = spool.stats().errors;
        let failed = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            spool.write_segments(asked(&writes[..5])),
        )
        .await
        .expect("the writes end");
        assert_eq!(failed.len(), 5, "{case}");
        for outcome in &failed {
            let e = outcome.as_ref().expect_err("the write fails");
            assert!(e.to_string().contains("cannot write"), "{case}: {e}");
        }
        assert_eq!(spool.stats().errors - errors_before, 5, "{case}");
        assert_eq!(
            std::fs::read(&dir).expect("still the file"),
            b"not a directory"
        );
        std::fs::remove_file(&dir).expect("remove");
    }
}

/// After failover, a consumer's DELETE releases a committed buffer: its
/// marker goes, and its segments go unless another marker of the task
/// (a BROADCAST buffer sharing them) still lists them.
#[tokio::test]
async fn releasing_a_committed_buffer_keeps_segments_other_markers_list() {
    let spool = Spool::open(SpoolConfig {
        stores: vec!["memory://".into()],
        node_name: "unit".into(),
        ..SpoolConfig::default()
    })
    .expect("open");
    let page = |b: u8| vec![Bytes::from(vec![b; 100])];
    let shared = spool
        .write("b", 0, page(1), Durability::Durable)
        .await
        .expect("write");
    let own = spool
        .write("b", 1, page(2), Durability::Durable)
        .await
        .expect("write");
    // A task whose name starts like this one's, with a marker of its own.
    let other_task = spool
        .write("bb", 0, page(3), Durability::Durable)
        .await
        .expect("write");
    let plan = marker_plan;
    spool
        .write_marker(&plan("b", 0, 2, &[&shared, &own]))
        .await
        .expect("marker 0");
    spool
        .write_marker(&plan("b", 1, 1, &[&shared]))
        .await
        .expect("marker 1");
    spool
        .write_marker(&plan("bb", 0, 1, &[&other_task]))
        .await
        .expect("marker of bb");
    let names = || async {
        let mut names: Vec<String> = spool.stores()[0]
            .list()
            .await
            .expect("list")
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        names.sort();
        names
    };
    assert_eq!(names().await.len(), 6);

    let marker0 = marker_of(&spool, "b", 0, "marker 0").await;
    assert_eq!(
        marker0.node, "unit",
        "a marker names the node that wrote it"
    );
    spool.release_committed(&marker0).await;
    let left = names().await;
    assert!(!left.contains(&"commit/b/0.json".to_string()), "{left:?}");
    assert!(!left.contains(&own.name), "its own segment went: {left:?}");
    assert!(
        left.contains(&shared.name),
        "marker 1 still lists it: {left:?}"
    );
    assert_eq!(left.len(), 4, "{left:?}");

    let marker1 = marker_of(&spool, "b", 1, "marker 1").await;
    spool.release_committed(&marker1).await;
    let left = names().await;
    assert_eq!(
        left,
        vec![other_task.name.clone(), "commit/bb/0.json".to_string()],
        "task bb is untouched"
    );
    assert_eq!(spool.stats().objects_deleted, 2);

    // A BROADCAST buffer's marker: its segments hold other buffers' pages,
    // whose readers (the producer itself, if it lives and its other
    // markers failed) may still need them; releasing it keeps them.
    let broadcast = spool
        .write("c", 0, page(4), Durability::Durable)
        .await
        .expect("write");
    spool
        .write_marker(&MarkerPlan {
            shared: true,
            ..plan("c", 0, 1, &[&broadcast])
        })
        .await
        .expect("marker of c");
    let marker = marker_of(&spool, "c", 0, "marker of c").await;
    assert!(marker.shared);
    spool.release_committed(&marker).await;
    let left = names().await;
    assert!(left.contains(&broadcast.name), "{left:?}");
    assert!(!left.contains(&"commit/c/0.json".to_string()), "{left:?}");
}

/// A restart prunes the overflow objects its node name left, except those a
/// commit marker names (a drain committed them for consumers to finish
/// from).
#[tokio::test]
async fn a_restart_prunes_leftovers_but_keeps_what_a_commit_marker_names() {
    let dir = fresh_dir("prune");
    let config = || SpoolConfig {
        stores: vec![format!("file://{}", dir.display())],
        node_name: "pod-a".into(),
        ..SpoolConfig::default()
    };
    let first = Spool::open(config()).expect("open");
    let page = vec![Bytes::from_static(b"page")];
    let committed = first
        .write("t", 0, page.clone(), Durability::Overflow)
        .await
        .expect("write");
    let leftover = first
        .write("t", 1, page, Durability::Overflow)
        .await
        .expect("write");
    first
        .write_marker(&MarkerPlan {
            task: TaskId::parse("t").unwrap(),
            buffer: 0,
            end_token: 1,
            objects: vec![std::sync::Arc::new(committed.clone())],
            shared: false,
        })
        .await
        .expect("marker");
    // The same node, restarted.
    let second = Spool::open(config()).expect("open");
    assert_eq!(second.prune(SystemTime::now(), true).await, 1);
    assert!(
        dir.join(&committed.name).exists(),
        "the committed object stays"
    );
    assert!(!dir.join(&leftover.name).exists(), "the leftover goes");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `file://` store is left as it was found once a task's objects, markers
/// and manifest are deleted: no directory per task stays behind (each task
/// has its own under `commit/`), and the next task's marker finds its way
/// in again.
#[tokio::test]
async fn a_local_store_keeps_no_directory_of_a_deleted_task() {
    let (dir, spool) = local_spool("dirs");
    let entries = || {
        let mut found = Vec::new();
        let mut todo = vec![dir.clone()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).expect("read_dir") {
                let path = e.expect("entry").path();
                if path.is_dir() {
                    todo.push(path.clone());
                }
                found.push(path.strip_prefix(&dir).unwrap().display().to_string());
            }
        }
        found.sort();
        found
    };
    for task in ["t1", "t2"] {
        let object = spool
            .write(
                task,
                0,
                vec![Bytes::from_static(b"page")],
                Durability::Durable,
            )
            .await
            .expect("write");
        spool
            .write_marker(&MarkerPlan {
                task: TaskId::parse(task).unwrap(),
                buffer: 0,
                end_token: 1,
                objects: vec![std::sync::Arc::new(object.clone())],
                shared: false,
            })
            .await
            .expect("marker");
        spool
            .write_manifest(&ManifestPlan {
                task: TaskId::parse(task).unwrap(),
                buffers: vec![(1, 4)],
                markers: Vec::new(),
            })
            .await
            .expect("manifest");
        let written = entries();
        assert!(
            written.contains(&format!("commit/{task}/0.json")),
            "{written:?}"
        );
        spool.delete_marker(task, 0).await.expect("delete marker");
        spool
            .delete_manifest(task, false)
            .await
            .expect("delete manifest");
        spool.delete(&object).await.expect("delete object");
        assert_eq!(entries(), Vec::<String>::new(), "after task {task}");
        assert!(dir.is_dir(), "the store's own directory stays");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A process killed in the middle of a put to a `file://` store leaves
/// object_store's staging file (`<name>#<digits>`), which listing hides:
/// the pruner deletes one older than `CUT_PUT_AGE`, never a younger one (a
/// put under way, perhaps another sidecar's on a shared volume), nor a file
/// that only looks like one. A killed process may also leave an empty task
/// directory (made for a put, or emptied by a delete before its cleanup):
/// the pruner removes those whatever their age, and never one that holds a
/// file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pruner_deletes_the_staging_files_of_puts_cut_short() {
    let (dir, spool) = local_spool("cut-puts");
    let task_dir = dir.join("commit").join("t.1.0");
    std::fs::create_dir_all(&task_dir).expect("mkdir");
    let old = SystemTime::now() - binx_spool::CUT_PUT_AGE - Duration::from_secs(1);
    let write = |name: &str, at: SystemTime| {
        let path = task_dir.join(name);
        let file = std::fs::File::create(&path).expect("create");
        file.set_modified(at).expect("set mtime");
        path
    };
    let cut = write("task.json#1", old);
    let under_way = write("0.json#7", SystemTime::now());
    let not_staging = write("1.json#x", old);
    let not_ours = write("notes.txt#1", old);
    let marker = write("2.json", old);
    // A task whose markers went, but for the staging file of a cut put:
    // its directory goes with it.
    let lone_dir = dir.join("commit").join("t.2.0");
    std::fs::create_dir_all(&lone_dir).expect("mkdir");
    let lone = lone_dir.join("task.json#3");
    std::fs::File::create(&lone)
        .expect("create")
        .set_modified(old)
        .expect("set mtime");
    // Empty task directories, one just made, one holding only an empty
    // directory.
    let empty_dir = dir.join("commit").join("t.3.0");
    std::fs::create_dir_all(&empty_dir).expect("mkdir");
    let nested_dir = dir.join("commit").join("t.4.0");
    std::fs::create_dir_all(nested_dir.join("x")).expect("mkdir");
    // Outside the commit directory object_store puts nothing: not looked at.
    let elsewhere = dir.join("notes#1");
    std::fs::File::create(&elsewhere)
        .expect("create")
        .set_modified(old)
        .expect("set mtime");
    assert_eq!(spool.prune(SystemTime::now(), false).await, 2);
    assert!(
        !cut.exists() && !lone.exists(),
        "the cut puts' staging files are pruned"
    );
    assert!(!lone_dir.exists(), "and a task directory left empty");
    assert!(
        !empty_dir.exists() && !nested_dir.exists(),
        "empty task directories are removed"
    );
    assert!(dir.join("commit").exists());
    assert!(under_way.exists() && not_staging.exists() && marker.exists() && elsewhere.exists());
    assert!(
        not_ours.exists(),
        "a file binx does not write is left alone"
    );
    // Once nothing is left under it, the commit directory goes too (as
    // object_store's own cleanup takes it), and the store's stays.
    for f in [&under_way, &not_staging, &marker, &not_ours] {
        std::fs::remove_file(f).expect("remove");
    }
    std::fs::create_dir_all(dir.join("commit").join("t.5.0")).expect("mkdir");
    assert_eq!(spool.prune(SystemTime::now(), false).await, 0);
    assert!(
        !dir.join("commit").exists(),
        "an empty commit directory goes"
    );
    assert!(
        dir.is_dir() && elsewhere.exists(),
        "the store's own directory stays"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The markers of a task-wide commit, written together: each reads back
/// as the single write would have made it, in a `file://` store (one job
/// on the blocking pool) and a `memory://` one (concurrent puts); a stale
/// staging file of a killed writer and a missing commit directory are no
/// obstacle; one marker that cannot be written fails alone, named. Deleted
/// together, they go with the task directories they leave empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn markers_written_and_deleted_together_as_one_at_a_time() {
    let dir = fresh_dir("markers-together");
    let spool = Spool::open(SpoolConfig {
        stores: vec![format!("file://{}", dir.display()), "memory://".into()],
        node_name: "unit".into(),
        ..SpoolConfig::default()
    })
    .expect("open");
    // Task ids as engines make them (`:` included), spread over both stores.
    let tasks: Vec<String> = (0..8).map(|t| format!("q:{t}.1.0")).collect();
    let mut plans = Vec::new();
    let mut objects = Vec::new();
    for task in &tasks {
        for buffer in 0..3u64 {
            let page = Bytes::from(vec![buffer as u8; 100 + buffer as usize]);
            let object = spool
                .write(task, 0, vec![page.clone(), page], Durability::Overflow)
                .await
                .expect("segment");
            objects.push(object.clone());
            plans.push(MarkerPlan {
                task: TaskId::parse(task).unwrap(),
                buffer,
                end_token: 2,
                objects: vec![std::sync::Arc::new(object)],
                shared: false,
            });
        }
    }
    let local: Vec<&String> = tasks.iter().filter(|t| spool.store_for(t) == 0).collect();
    assert!(
        !local.is_empty() && local.len() < tasks.len(),
        "tasks spread over both stores"
    );
    // A writer killed mid-put left its staging file; another left the
    // directory of a task empty; a third task's directory is a file.
    let commit = dir.join("commit");
    std::fs::create_dir_all(commit.join(local[0])).unwrap();
    std::fs::write(commit.join(local[0]).join("1.json#1"), b"cut short").unwrap();
    let blocked = local[1];
    std::fs::write(commit.join(blocked), b"not a directory").unwrap();

    let results = spool.write_markers(&plans).await;
    assert_eq!(results.len(), plans.len());
    for (plan, result) in plans.iter().zip(&results) {
        if plan.task.as_str() == blocked.as_str() {
            let e = result.as_ref().expect_err("its directory is a file");
            assert!(e.is_transient(), "{e}");
            assert!(e.to_string().contains(blocked.as_str()), "names it: {e}");
            continue;
        }
        result.as_ref().expect("written");
        let marker = marker_of(&spool, plan.task.as_str(), plan.buffer, "there").await;
        assert_eq!(marker.end_token, 2);
        assert_eq!(marker.node, "unit");
        assert_eq!(marker.segments.len(), 1);
        assert_eq!(marker.segments[0].name, plan.objects[0].name);
        assert_eq!(marker.segments[0].page_sizes, plan.objects[0].page_sizes);
    }
    // The stale staging file is left to the pruner (it is not ours to
    // judge); no staging file of this write is left.
    let mut staged: Vec<String> = Vec::new();
    for task in &local {
        if task.as_str() == blocked.as_str() {
            continue;
        }
        for entry in std::fs::read_dir(commit.join(task)).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            if name.contains('#') {
                staged.push(format!("{task}/{name}"));
            }
        }
    }
    assert_eq!(staged, vec![format!("{}/1.json#1", local[0])]);
    assert_eq!(
        std::fs::read(commit.join(local[0]).join("1.json#1")).unwrap(),
        b"cut short"
    );
    // Written alone, the same marker is the same file.
    let alone = plans
        .iter()
        .find(|p| p.task.as_str() == local[0].as_str())
        .unwrap();
    let together = std::fs::read(commit.join(local[0]).join("0.json")).unwrap();
    spool.write_marker(alone).await.expect("alone");
    assert_eq!(
        std::fs::read(commit.join(local[0]).join("0.json")).unwrap(),
        together
    );

    // Deleted together: every marker goes (one never written, or gone
    // already, counts as deleted), and each task directory left empty.
    let gone: Vec<(&str, u64)> = plans.iter().map(|p| (p.task.as_str(), p.buffer)).collect();
    let results = spool.delete_markers(&gone).await;
    assert_eq!(results.len(), gone.len());
    for ((task, buffer), result) in gone.iter().zip(&results) {
        if *task == blocked.as_str() {
            let e = result.as_ref().expect_err("its directory is a file");
            assert!(e.to_string().contains(blocked.as_str()), "names it: {e}");
            continue;
        }
        result.as_ref().expect("deleted");
        assert!(
            spool
                .read_marker(task, *buffer)
                .await
                .expect("read")
                .is_none(),
            "marker {buffer} of {task} is gone"
        );
    }
    let mut left: Vec<String> = std::fs::read_dir(&commit)
        .expect("commit/ stays while something is in it")
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    let mut expected = vec![local[0].clone(), blocked.clone()];
    expected.sort();
    assert_eq!(
        left, expected,
        "only the directory the stale staging file keeps, and the file in the way"
    );
    for object in &objects {
        assert!(spool.read(object).await.is_ok(), "segments are not touched");
    }
    // The last markers of the last task go: so does `commit/`, and no
    // more than that.
    std::fs::remove_file(commit.join(blocked)).unwrap();
    std::fs::remove_file(commit.join(local[0]).join("1.json#1")).unwrap();
    let last = plans
        .iter()
        .find(|p| p.task.as_str() == local[0].as_str())
        .unwrap();
    spool.write_marker(last).await.expect("again");
    let results = spool
        .delete_markers(&[(last.task.as_str(), last.buffer)])
        .await;
    assert!(results[0].is_ok(), "{results:?}");
    assert!(!commit.exists(), "commit/ went with its last task");
    assert!(dir.exists(), "the store's own directory stays");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A buffer of so many pages that its marker would pass what a reader
/// takes (`MAX_MARKER_BYTES`, 64 MiB) is not committed: the write fails,
/// naming the buffer, and no marker is left that every reader would refuse.
#[tokio::test]
async fn a_marker_too_large_for_any_reader_is_refused_when_written() {
    let (dir, spool) = local_spool("huge-marker");
    let object = one_page(&spool, "t").await;
    // 8 segments of 2^20 pages of 16 MiB ("16777216," is 9 bytes): 72 MiB.
    let objects = (0..8u64)
        .map(|i| {
            std::sync::Arc::new(ObjectMeta {
                first_token: i << 20,
                page_sizes: vec![16 << 20; 1 << 20],
                ..object.clone()
            })
        })
        .collect();
    let plan = MarkerPlan {
        task: TaskId::parse("t").unwrap(),
        buffer: 0,
        end_token: 8 << 20,
        objects,
        shared: false,
    };
    let err = spool.write_marker(&plan).await.expect_err("too large");
    let text = err.to_string();
    assert!(text.contains("commit/t/0.json"), "{text}");
    assert!(text.contains("more than a reader takes"), "{text}");
    assert!(text.contains("8388608 pages"), "{text}");
    assert!(!dir.join("commit/t/0.json").exists());
    for outcome in spool.write_markers(std::slice::from_ref(&plan)).await {
        assert!(outcome.is_err());
    }
    assert!(!dir.join("commit/t/0.json").exists());
    assert!(spool.read_marker("t", 0).await.expect("read").is_none());
    // 7 segments of 2^20 pages of 1 KiB (what a reader takes of one
    // segment: 1 GiB) fit, and read back.
    let mut fits = plan.clone();
    fits.objects.truncate(7);
    for object in &mut fits.objects {
        std::sync::Arc::make_mut(object).page_sizes = vec![1024; 1 << 20];
    }
    fits.end_token = 7 << 20;
    spool.write_marker(&fits).await.expect("a marker that fits");
    let marker = spool
        .read_marker("t", 0)
        .await
        .expect("read")
        .expect("marker");
    assert_eq!(marker.end_token, 7 << 20);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Markers read back are hostile until checked: one of another format, of
/// another buffer or task, not JSON, naming a store this binxd lacks, or
/// (in a cluster with a secret) not signed with it, is refused, naming the
/// file, and is not a transient failure (asking again gets the same).
#[tokio::test]
async fn markers_read_back_are_checked_before_anything_of_them_is_believed() {
    let (dir, spool) = local_spool("hostile-markers");
    let object = one_page(&spool, "t").await;
    let plan = MarkerPlan {
        task: TaskId::parse("t").unwrap(),
        buffer: 0,
        end_token: 1,
        objects: vec![std::sync::Arc::new(object)],
        shared: false,
    };
    spool.write_marker(&plan).await.expect("marker");
    let path = dir.join("commit/t/0.json");
    let honest = json_at(&path);
    assert!(spool.read_marker("t", 0).await.expect("read").is_some());
    let altered = |change: &dyn Fn(&mut serde_json::Value)| altered(&honest, change);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "format",
            altered(&|v| v["format"] = 3.into()),
            "has format 3, not 1 or 2",
        ),
        (
            "task",
            altered(&|v| v["task_id"] = "u".into()),
            "names buffer 0 of task u",
        ),
        (
            "buffer",
            altered(&|v| v["buffer_id"] = 7.into()),
            "names buffer 7 of task t",
        ),
        (
            "store",
            altered(&|v| v["segments"][0]["store"] = 3.into()),
            "is in store 3, and this binxd has 1",
        ),
        (
            "json",
            b"{\"format\": 1, \"task_id\"".to_vec(),
            "not a commit marker",
        ),
        (
            // Sizes whose sums overflow (a review found a debug build's
            // failover planning panic on them).
            "page size",
            altered(&|v| v["segments"][0]["page_sizes"] = serde_json::json!([u64::MAX, 1])),
            "lists a page of 18446744073709551615 bytes, larger than any frame can carry",
        ),
        (
            // Read whole on the strength of it: 20 GiB for one page.
            "stored size",
            altered(&|v| v["segments"][0]["stored_size"] = (20u64 << 30).into()),
            "stored in 21474836480 bytes",
        ),
        (
            "page count",
            altered(&|v| v["segments"][0]["page_sizes"] = serde_json::json!(vec![0; 1 << 21])),
            "lists 2097152 pages",
        ),
        (
            // A read or a delete must never reach another object.
            "name",
            altered(&|v| v["segments"][0]["name"] = "commit/u/task.json".into()),
            "segment \"commit/u/task.json\" is not named as binx names its objects",
        ),
        (
            // Out of order, a failover reply served pages twice.
            "order",
            altered(&|v| {
                let mut later = v["segments"][0].clone();
                later["first_token"] = 1.into();
                let earlier = v["segments"][0].clone();
                v["segments"] = serde_json::json!([later, earlier]);
            }),
            "segments must start in increasing token order",
        ),
        (
            "last token",
            altered(&|v| v["segments"][0]["first_token"] = u64::MAX.into()),
            "end below 2^64",
        ),
    ];
    for (what, bytes, says) in cases {
        std::fs::write(&path, bytes).unwrap();
        let e = spool.read_marker("t", 0).await.expect_err(what);
        assert_refused(&e, what, says, "commit/t/0.json");
    }

    // Signed by this cluster's secret: an unsigned or altered one is refused.
    let signed = signed_spool(&dir);
    std::fs::write(&path, serde_json::to_vec(&honest).unwrap()).unwrap();
    let e = signed.read_marker("t", 0).await.expect_err("unsigned");
    assert!(
        e.to_string()
            .contains("is not signed with this cluster's shared_secret"),
        "{e}"
    );
    signed.write_marker(&plan).await.expect("signed marker");
    assert!(signed.read_marker("t", 0).await.expect("read").is_some());
    let mut forged: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    forged["end_token"] = 2.into();
    std::fs::write(&path, serde_json::to_vec(&forged).unwrap()).unwrap();
    let e = signed.read_marker("t", 0).await.expect_err("altered");
    assert!(e.to_string().contains("is not signed"), "{e}");
    // The MAC is checked on the bytes before they are parsed: 48 MiB of
    // page sizes (a few hundred MiB once parsed), unsigned, is refused as
    // unsigned, and so is what is no JSON at all.
    let mut huge = br#"{"format":1,"task_id":"t","buffer_id":0,"end_token":1,"segments":[{"store":0,"name":"x","first_token":0,"stored_size":1,"wrapped_key":null,"page_sizes":["#.to_vec();
    huge.extend(std::iter::repeat_n(*b"0,", 24 << 20).flatten());
    huge.extend(br#"0]}],"shared":false}"#);
    for (what, bytes) in [
        ("huge", huge),
        ("no JSON", b"{\"format\": 1, \"task_id\"".to_vec()),
    ] {
        std::fs::write(&path, bytes).unwrap();
        let e = signed.read_marker("t", 0).await.expect_err(what);
        assert!(e.to_string().contains("is not signed"), "{what}: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// An object read back once is cached by what it was read as: asked for
/// under another first token (a marker that says so: forged, or of another
/// object), it is read and checked again, and refused, never served from
/// the cache under tokens that are not its own.
#[tokio::test]
async fn a_cached_object_is_served_only_as_what_it_was_read_as() {
    let (dir, spool) = local_spool("cache-identity");
    let pages = vec![Bytes::from_static(b"one"), Bytes::from_static(b"two")];
    let object = spool
        .write("t", 5, pages.clone(), Durability::Overflow)
        .await
        .expect("segment");
    assert_eq!(*spool.read(&object).await.expect("read"), pages);
    let reads = spool.stats().objects_read;
    assert_eq!(*spool.read(&object).await.expect("cached"), pages);
    assert_eq!(spool.stats().objects_read, reads, "served from the cache");
    let elsewhere = ObjectMeta {
        first_token: 6,
        ..object.clone()
    };
    let e = spool.read(&elsewhere).await.expect_err("not its tokens");
    assert!(!e.is_transient(), "{e}");
    assert!(e.to_string().contains(&object.name), "{e}");
    // Named with a key it was not read with, other page sizes or another
    // stored size, it is read again and refused too.
    let others = [
        ObjectMeta {
            key: Some([1; 32]),
            ..object.clone()
        },
        ObjectMeta {
            page_sizes: vec![2, 4],
            ..object.clone()
        },
        ObjectMeta {
            stored_size: object.stored_size + 1,
            ..object.clone()
        },
    ];
    for other in &others {
        let e = spool.read(other).await.expect_err("not what was read");
        assert!(e.to_string().contains(&object.name), "{e}");
    }
    assert_eq!(*spool.read(&object).await.expect("still itself"), pages);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A wide task's markers (more than one job on the blocking pool takes)
/// are all written and all deleted, each where the single write puts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wide_tasks_markers_are_written_and_deleted_in_several_jobs() {
    let (dir, spool) = local_spool("wide-markers");
    let object = one_page(&spool, "wide").await;
    let plans: Vec<MarkerPlan> = (0..1000u64)
        .map(|buffer| MarkerPlan {
            task: TaskId::parse("wide").unwrap(),
            buffer,
            end_token: 1,
            objects: vec![std::sync::Arc::new(object.clone())],
            shared: false,
        })
        .collect();
    let written = spool.write_markers(&plans).await;
    assert!(written.iter().all(Result::is_ok), "{written:?}");
    let files = std::fs::read_dir(dir.join("commit/wide")).unwrap().count();
    assert_eq!(files, 1000);
    for buffer in [0, 127, 128, 999] {
        let marker = marker_of(&spool, "wide", buffer, "there").await;
        assert_eq!(marker.buffer_id, buffer);
    }
    let gone: Vec<(&str, u64)> = (0..1000).map(|b| ("wide", b)).collect();
    let deleted = spool.delete_markers(&gone).await;
    assert!(deleted.iter().all(Result::is_ok), "{deleted:?}");
    assert!(
        !dir.join("commit").exists(),
        "every marker went, and their directories"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A task-wide commit of a PARTITIONED task folds its buffers' markers into
/// the manifest (format 2): one object for the task, none a buffer. Each
/// reads back as the marker it stands for; a consumer that finished one
/// from storage records its release beside the manifest (its segment goes,
/// the other buffers' stay), and the last release takes the manifest, the
/// records and the task's directory. A restart's prune spares what a
/// folded marker names.
#[tokio::test]
async fn folded_markers_read_back_and_are_released_beside_their_manifest() {
    let (dir, spool) = local_spool("folded");
    let task = TaskId::parse("f").unwrap();
    let o0 = one_page(&spool, "f").await;
    let o2 = one_page(&spool, "f").await;
    let marker =
        |buffer, end_token, objects: &[&ObjectMeta]| marker_plan("f", buffer, end_token, objects);
    spool
        .write_manifest(&ManifestPlan {
            task: task.clone(),
            buffers: vec![(1, 4), (0, 0), (1, 4)],
            markers: vec![
                marker(0, 1, &[&o0]),
                marker(1, 0, &[]),
                marker(2, 1, &[&o2]),
            ],
        })
        .await
        .expect("manifest");
    let listed = |sub: &str| sorted_names(&dir.join(sub));
    assert_eq!(listed("commit/f"), vec!["task.json"], "no marker objects");
    let manifest = spool
        .read_manifest("f", 16)
        .await
        .expect("read")
        .expect("manifest");
    assert_eq!(manifest.buffers, vec![(1, 4), (0, 0), (1, 4)]);

    // A restart's prune spares the overflow objects the folded markers name.
    let restarted = file_spool(&dir, Encryption::Auto);
    assert_eq!(restarted.prune(SystemTime::now(), true).await, 0);
    assert!(dir.join(&o0.name).exists() && dir.join(&o2.name).exists());

    let m0 = marker_of(&spool, "f", 0, "folded 0").await;
    assert!(m0.folded && !m0.shared);
    assert_eq!(
        (m0.task_id.as_str(), m0.buffer_id, m0.end_token),
        ("f", 0, 1)
    );
    assert_eq!(m0.node, "unit");
    assert_eq!(m0.segments.len(), 1);
    assert_eq!(
        (
            m0.segments[0].name.as_str(),
            m0.segments[0].page_sizes.as_slice()
        ),
        (o0.name.as_str(), [4u64].as_slice())
    );
    assert_eq!(
        *spool.read(&m0.segments[0]).await.expect("its pages"),
        vec![Bytes::from_static(b"page")]
    );
    let m1 = marker_of(&spool, "f", 1, "folded 1").await;
    assert!(m1.segments.is_empty() && m1.end_token == 0);
    assert!(spool.read_marker("f", 3).await.expect("read").is_none());

    spool.release_committed(&m0).await;
    assert_eq!(listed("commit/f"), vec!["0.released", "task.json"]);
    assert!(!dir.join(&o0.name).exists(), "its segment went");
    assert!(
        dir.join(&o2.name).exists(),
        "buffer 2's marker still names it"
    );
    assert!(
        spool.read_marker("f", 0).await.expect("read").is_none(),
        "a released marker is not read again"
    );
    let m2 = marker_of(&spool, "f", 2, "folded 2").await;
    spool.release_committed(&m2).await;
    assert!(!dir.join(&o2.name).exists());
    assert_eq!(
        listed("commit/f"),
        vec!["0.released", "2.released", "task.json"],
        "buffer 1's marker is not released yet"
    );
    spool.release_committed(&m1).await;
    assert!(
        listed("commit").is_empty(),
        "the last release takes the manifest, the records and the directory: {:?}",
        listed("commit/f")
    );

    // A producer that was only cut off deletes its manifest at its task's
    // end: the records of what consumers released through failover go too.
    let o = one_page(&spool, "g").await;
    let g = TaskId::parse("g").unwrap();
    spool
        .write_manifest(&ManifestPlan {
            task: g.clone(),
            buffers: vec![(1, 4), (1, 4)],
            markers: vec![
                MarkerPlan {
                    task: g.clone(),
                    ..marker(0, 1, &[&o])
                },
                MarkerPlan {
                    task: g.clone(),
                    ..marker(1, 1, &[&o])
                },
            ],
        })
        .await
        .expect("manifest");
    let g0 = marker_of(&spool, "g", 0, "folded").await;
    spool.release_committed(&g0).await;
    assert_eq!(listed("commit/g"), vec!["0.released", "task.json"]);
    spool.delete_manifest("g", true).await.expect("delete");
    assert!(listed("commit").is_empty(), "{:?}", listed("commit/g"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Consumers that finish many buffers of two tasks from storage at once (a
/// query's exchange deleted): each task's releases take their turns, the
/// last of each takes its manifest and records, every segment goes, and
/// no task is left counted as releasing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_of_many_buffers_at_once_leave_nothing() {
    let (dir, spool) = local_spool("released-at-once");
    let buffers = 24u64;
    let mut markers = Vec::new();
    let mut objects = Vec::new();
    for task in ["r1", "r2"] {
        let mut plans = Vec::new();
        for buffer in 0..buffers {
            let object = one_page(&spool, task).await;
            plans.push(marker_plan(task, buffer, 1, &[&object]));
            objects.push(object);
        }
        spool
            .write_manifest(&ManifestPlan {
                task: TaskId::parse(task).unwrap(),
                buffers: vec![(1, 4); buffers as usize],
                markers: plans,
            })
            .await
            .expect("manifest");
        for buffer in 0..buffers {
            markers.push(marker_of(&spool, task, buffer, "folded").await);
        }
    }
    assert!(objects.iter().all(|o| dir.join(&o.name).exists()));
    futures_util::future::join_all(markers.iter().map(|m| spool.release_committed(m))).await;
    let left: Vec<&str> = objects
        .iter()
        .filter(|o| dir.join(&o.name).exists())
        .map(|o| o.name.as_str())
        .collect();
    assert!(left.is_empty(), "segments left: {left:?}");
    assert!(
        sorted_names(&dir.join("commit")).is_empty(),
        "{:?} {:?}",
        sorted_names(&dir.join("commit/r1")),
        sorted_names(&dir.join("commit/r2"))
    );
    let stats = spool.stats();
    assert_eq!(stats.release_tasks, 0);
    assert_eq!(stats.errors, 0);
    assert_eq!(stats.objects_deleted, 2 * buffers);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes the segments of `pages` (each at token 0) for `task` at once,
/// as a commit writes its buffers' last pages (they may be packed).
async fn commit_writes(
    spool: &Spool,
    task: &str,
    pages: impl Iterator<Item = Vec<Bytes>>,
) -> Vec<Result<ObjectMeta, binx_spool::SpoolError>> {
    spool
        .write_segments(
            pages
                .map(|pages| binx_spool::SegmentWrite {
                    task: task.into(),
                    first_token: 0,
                    pages,
                    durability: Durability::Overflow,
                    pack: true,
                })
                .collect(),
        )
        .await
}

/// A task-wide commit's small segments of a `file://` store are packed
/// into one file: the manifest lists each as a range of it (format 3), a
/// restart spares it, a consumer that finishes one buffer from storage
/// keeps the pack while another buffer's marker lists a range of it, the
/// last release takes it; a release with no manifest (the producer may
/// still write markers that list the pack) never takes it; and a range
/// that lies outside its pack is refused for good, named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packed_segments_of_a_commit_are_read_back_and_released_with_their_last_buffer() {
    let (dir, spool) = local_spool("packed");
    let task = TaskId::parse("p").unwrap();
    let pages = |b: u8| {
        vec![
            Bytes::from(vec![b; 100 + usize::from(b)]),
            Bytes::from(vec![b; 7]),
        ]
    };
    let written = commit_writes(&spool, "p", (0..3u8).map(pages)).await;
    let objects: Vec<ObjectMeta> = written.into_iter().map(|w| w.expect("written")).collect();
    let pack = object_of(&objects[0].name).to_string();
    for (b, object) in objects.iter().enumerate() {
        let packed = PackedName::parse(&object.name).expect("packed");
        assert_eq!(packed.pack, pack, "one file for the task's three");
        assert_eq!(
            *spool.read(object).await.expect("read"),
            pages(b as u8),
            "each reads back as its own"
        );
    }
    let files = |sub: &str| sorted_names(&dir.join(sub));
    assert_eq!(files(""), vec![pack.clone()]);
    let marker = |buffer: u64| marker_plan("p", buffer, 2, &[&objects[buffer as usize]]);
    spool
        .write_manifest(&ManifestPlan {
            task: task.clone(),
            buffers: vec![(2, 107), (2, 108), (2, 109)],
            markers: vec![marker(0), marker(1), marker(2)],
        })
        .await
        .expect("manifest");
    assert_eq!(json_at(&dir.join("commit/p/task.json"))["format"], 3);

    // A restart's prune spares the pack the manifest names ranges of.
    let restarted = file_spool(&dir, Encryption::Auto);
    assert_eq!(restarted.prune(SystemTime::now(), true).await, 0);
    assert!(dir.join(&pack).exists());

    // Consumers on another sidecar (the restarted one) finish each buffer
    // from storage: the pack stays until the last.
    for buffer in 0..3u64 {
        let m = marker_of(&restarted, "p", buffer, "folded").await;
        assert_eq!(m.segments[0].name, objects[buffer as usize].name);
        assert_eq!(
            *restarted.read(&m.segments[0]).await.expect("read"),
            pages(buffer as u8)
        );
        restarted.release_committed(&m).await;
        assert_eq!(
            dir.join(&pack).exists(),
            buffer < 2,
            "after buffer {buffer}'s release"
        );
    }
    assert!(files("commit").is_empty(), "{:?}", files("commit/p"));

    // Markers of their own, no manifest: a release keeps the pack (the
    // producer may still commit another buffer with a range of it).
    let written = commit_writes(&spool, "q", (0..2u8).map(pages)).await;
    let objects: Vec<ObjectMeta> = written.into_iter().map(|w| w.expect("written")).collect();
    let pack = object_of(&objects[0].name).to_string();
    spool
        .write_marker(&marker_plan("q", 0, 2, &[&objects[0]]))
        .await
        .expect("marker");
    assert_eq!(json_at(&dir.join("commit/q/0.json"))["format"], 2);
    let m = marker_of(&restarted, "q", 0, "marker").await;
    restarted.release_committed(&m).await;
    assert!(!dir.join("commit/q/0.json").exists(), "the marker went");
    assert!(dir.join(&pack).exists(), "the pack stays");
    // The producer deletes the pack with its last segment.
    spool.delete(&objects[0]).await.expect("delete");
    assert!(dir.join(&pack).exists(), "one segment of it lives");
    spool.delete(&objects[0]).await.expect("deleted twice");
    assert!(
        dir.join(&pack).exists(),
        "a segment deleted twice counts once"
    );
    spool.delete(&objects[1]).await.expect("delete");
    assert!(!dir.join(&pack).exists(), "the last segment took it");

    // A range outside its pack, or a pack that is not there: refused.
    let written = commit_writes(&spool, "r", (0..2u8).map(pages)).await;
    let object = written.into_iter().next().expect("one").expect("written");
    let pack = object_of(&object.name).to_string();
    let size = std::fs::metadata(dir.join(&pack)).expect("pack").len();
    let cases = [
        (
            "past the end",
            PackedName::format(&pack, size),
            object.stored_size,
        ),
        (
            "across the end",
            PackedName::format(&pack, size - 10),
            object.stored_size,
        ),
        (
            "far past it",
            PackedName::format(&pack, u64::MAX - 1),
            object.stored_size,
        ),
    ];
    for (what, name, stored_size) in cases {
        let forged = ObjectMeta {
            name,
            stored_size,
            ..object.clone()
        };
        let e = restarted.read(&forged).await.expect_err(what);
        assert!(!e.is_transient(), "{what}: {e}");
        assert!(e.to_string().contains(&pack), "{what} names the pack: {e}");
    }
    let gone = ObjectMeta {
        name: PackedName::format(&pack.replace("-o-", "-a-"), 0),
        ..object.clone()
    };
    let e = restarted.read(&gone).await.expect_err("no such pack");
    assert!(e.to_string().contains(object_of(&gone.name)), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A manifest with markers folded in is checked as a marker is before any
/// of it is believed: its format (2 with markers, 1 without), its markers
/// in increasing buffer order and within its buffers, their stores, and
/// (in a cluster with a secret) its signature over the markers too. Each
/// is refused, named, and not transient.
#[tokio::test]
async fn folded_manifests_are_checked_before_anything_of_them_is_believed() {
    let (dir, spool) = local_spool("hostile-folded");
    let task = TaskId::parse("t").unwrap();
    let object = one_page(&spool, "t").await;
    let plan = ManifestPlan {
        task: task.clone(),
        buffers: vec![(1, 4), (0, 0)],
        markers: vec![
            marker_plan("t", 0, 1, &[&object]),
            marker_plan("t", 1, 0, &[]),
        ],
    };
    spool.write_manifest(&plan).await.expect("manifest");
    let path = dir.join("commit/t/task.json");
    let honest = json_at(&path);
    assert_eq!(honest["format"], 2);
    assert!(spool.read_marker("t", 0).await.expect("read").is_some());
    let altered = |change: &dyn Fn(&mut serde_json::Value)| altered(&honest, change);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "format 1 with markers",
            altered(&|v| v["format"] = 1.into()),
            "has format 1 and markers in it",
        ),
        (
            "format 4",
            altered(&|v| v["format"] = 4.into()),
            "has format 4, not 1, 2 or 3",
        ),
        (
            "order",
            altered(&|v| {
                v["markers"][0]["buffer_id"] = 1.into();
                v["markers"][1]["buffer_id"] = 0.into();
            }),
            "out of order or past its 2 buffers",
        ),
        (
            "past the buffers",
            altered(&|v| v["markers"][1]["buffer_id"] = 2.into()),
            "carries a marker of buffer 2",
        ),
        (
            "store",
            altered(&|v| v["markers"][0]["segments"][0]["store"] = 3.into()),
            "is in store 3, and this binxd has 1",
        ),
        (
            "task",
            altered(&|v| v["task_id"] = "u".into()),
            "names task u",
        ),
    ];
    // A manifest read back is kept for a few seconds (each buffer's
    // failover reads its marker): replaced meanwhile, it is not read again.
    std::fs::write(&path, b"{}").unwrap();
    assert!(
        spool.read_marker("t", 1).await.expect("kept").is_some(),
        "served from the manifest read before"
    );
    // A sidecar that did not read it yet reads what is there now.
    let fresh = || {
        Spool::open(SpoolConfig {
            stores: vec![format!("file://{}", dir.display())],
            node_name: "unit".into(),
            ..SpoolConfig::default()
        })
        .expect("open")
    };
    for (what, bytes, says) in cases {
        std::fs::write(&path, bytes).unwrap();
        let e = fresh().read_marker("t", 0).await.expect_err(what);
        assert_refused(&e, what, says, "commit/t/task.json");
    }

    let signed_spool = || signed_spool(&dir);
    std::fs::write(&path, serde_json::to_vec(&honest).unwrap()).unwrap();
    let e = signed_spool()
        .read_marker("t", 0)
        .await
        .expect_err("unsigned");
    assert!(e.to_string().contains("is not signed"), "{e}");
    let signed = signed_spool();
    signed.write_manifest(&plan).await.expect("signed manifest");
    assert!(
        signed_spool()
            .read_marker("t", 0)
            .await
            .expect("read")
            .is_some()
    );
    let mut forged: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    forged["markers"][0]["segments"][0]["first_token"] = 7.into();
    std::fs::write(&path, serde_json::to_vec(&forged).unwrap()).unwrap();
    let e = signed
        .read_marker("t", 0)
        .await
        .expect_err("altered marker");
    assert!(e.to_string().contains("is not signed"), "{e}");
    let e = signed
        .read_manifest("t", 16)
        .await
        .expect_err("altered manifest");
    assert!(e.to_string().contains("is not signed"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A marker names the process that wrote it (binxd sets its instance at
/// start): a sidecar that read the buffer from one process serves only
/// that process's marker. Read back from storage it is checked like the
/// rest: an instance that is not an id refuses the marker, naming it.
#[tokio::test]
async fn a_marker_names_the_process_that_wrote_it_and_a_bad_one_is_refused() {
    let dir = fresh_dir("instance");
    let spool = file_spool(&dir, Encryption::Off);
    let unnamed = one_page(&spool, "i").await;
    spool
        .write_marker(&marker_plan("i", 0, 1, &[&unnamed]))
        .await
        .expect("marker");
    assert_eq!(marker_of(&spool, "i", 0, "marker").await.instance, None);
    spool.set_instance("0123456789abcdef".into());
    let named = one_page(&spool, "j").await;
    spool
        .write_marker(&marker_plan("j", 0, 1, &[&named]))
        .await
        .expect("marker");
    let marker = marker_of(&spool, "j", 0, "marker").await;
    assert_eq!(marker.instance.as_deref(), Some("0123456789abcdef"));
    let path = dir.join("commit/j/0.json");
    let stored = std::fs::read_to_string(&path).expect("the marker object");
    assert!(
        stored.contains(r#""instance":"0123456789abcdef""#),
        "{stored}"
    );
    for bad in ["", "has space", "a\nlog line", &"x".repeat(65)] {
        let forged = stored.replace(
            r#""instance":"0123456789abcdef""#,
            &format!(r#""instance":{}"#, serde_json::to_string(bad).unwrap()),
        );
        std::fs::write(&path, forged).expect("forged");
        let err = spool.read_marker("j", 0).await.expect_err("refused");
        assert!(
            err.to_string().contains("process instance"),
            "{bad:?}: {err}"
        );
    }
}

/// A task id opened again after its producer restarted commits its
/// buffers at the same paths as the earlier run did. A consumer that
/// finished a buffer of the earlier run releases only that run's commit:
/// the new run's marker (or manifest entry) stays and reads back as the
/// new run's, its segments stay, and release records of the earlier run
/// release nothing of the new one.
#[tokio::test]
async fn releasing_an_earlier_run_of_a_task_id_leaves_the_new_runs_commit() {
    let dir = fresh_dir("rerun");
    let run = |instance: &str| {
        let spool = file_spool(&dir, Encryption::Off);
        spool.set_instance(instance.into());
        spool
    };
    let (earlier, later) = (run("earlier-1"), run("later-2"));
    let reader = file_spool(&dir, Encryption::Off);

    // A marker of its own: the new run's marker replaced the one read.
    let old = one_page(&earlier, "r").await;
    earlier
        .write_marker(&marker_plan("r", 0, 1, &[&old]))
        .await
        .expect("marker");
    let read = marker_of(&reader, "r", 0, "earlier marker").await;
    let new = one_page(&later, "r").await;
    later
        .write_marker(&marker_plan("r", 0, 1, &[&new]))
        .await
        .expect("marker");
    reader.release_committed(&read).await;
    assert!(
        !dir.join(&old.name).exists(),
        "the earlier run's segment went"
    );
    assert!(dir.join(&new.name).exists(), "the new run's segment stays");
    let stays = marker_of(&reader, "r", 0, "new marker").await;
    assert_eq!(stays.instance.as_deref(), Some("later-2"));
    assert_eq!(stays.segments[0].name, new.name);

    // Folded into manifests: the earlier run's reader released buffer 0
    // (its record), then the task committed again.
    let manifest = |spool: std::sync::Arc<Spool>, objects: [ObjectMeta; 2]| async move {
        let task = TaskId::parse("m").unwrap();
        spool
            .write_manifest(&ManifestPlan {
                task: task.clone(),
                buffers: vec![(1, 4), (1, 4)],
                markers: vec![
                    marker_plan("m", 0, 1, &[&objects[0]]),
                    marker_plan("m", 1, 1, &[&objects[1]]),
                ],
            })
            .await
            .expect("manifest");
    };
    let old = [one_page(&earlier, "m").await, one_page(&earlier, "m").await];
    manifest(earlier.clone(), old.clone()).await;
    let released = marker_of(&reader, "m", 0, "earlier folded 0").await;
    reader.release_committed(&released).await;
    assert!(!dir.join(&old[0].name).exists());
    let read1 = marker_of(&reader, "m", 1, "earlier folded 1").await;
    let new = [one_page(&later, "m").await, one_page(&later, "m").await];
    manifest(later.clone(), new.clone()).await;
    // A fresh reader (no manifest cached), as on another node.
    let other = file_spool(&dir, Encryption::Off);
    let new0 = marker_of(&other, "m", 0, "the new run's buffer 0").await;
    assert_eq!(
        (new0.instance.as_deref(), new0.segments[0].name.as_str()),
        (Some("later-2"), new[0].name.as_str()),
        "the earlier run's record does not release the new run's buffer"
    );
    // The earlier run's buffer 1, finished after the new run committed.
    other.release_committed(&read1).await;
    assert!(!dir.join(&old[1].name).exists());
    let new1 = marker_of(&other, "m", 1, "the new run's buffer 1").await;
    assert_eq!(new1.segments[0].name, new[1].name);
    assert!(new.iter().all(|o| dir.join(&o.name).exists()));
    // The new run's buffers released: everything goes.
    other.release_committed(&new0).await;
    other.release_committed(&new1).await;
    assert!(new.iter().all(|o| !dir.join(&o.name).exists()));
    assert!(
        sorted_names(&dir.join("commit")).iter().all(|t| t == "r"),
        "task m's manifest and records went: {:?}",
        sorted_names(&dir.join("commit/m"))
    );
    let _ = std::fs::remove_dir_all(&dir);
}
