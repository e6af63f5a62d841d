//! The spool over a `memory://` and a `file://` store at once: tasks are
//! spread over both, objects read back exactly, released objects are
//! deleted, and expired ones pruned.

use std::time::{Duration, SystemTime};

use binx_spool::{Codec, Durability, Encryption, Spool, SpoolConfig};
use bytes::Bytes;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stores_share_the_tasks_and_lose_nothing() {
    let dir = std::env::temp_dir().join(format!("binx-spool-stores-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
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
    drop(objects);
    assert_eq!(spool.delete_released().await, 16);
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
    let later = SystemTime::now() + Duration::from_secs(13 * 3600);
    assert_eq!(spool.prune(later, false).await, 4);
    assert_eq!(spool.stats().objects_pruned, 4);
    let _ = std::fs::remove_dir_all(&dir);
}
