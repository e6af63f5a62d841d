//! The byte stream over real memfd regions, passed over a real Unix socket
//! pair with SCM_RIGHTS, as sidecar and client set it up.

use std::time::Duration;

use binx_shm::layout::SUBMIT_HEAD_AT;
use binx_shm::pass::{recv_with_fds, send_with_fds};
use binx_shm::{Link, Regions, ShmConfig, ShmReader, ShmWriter, attach, serve};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

type Side = (ShmReader, ShmWriter, std::sync::Arc<Link>);

async fn pair(config: ShmConfig) -> (Side, Side) {
    let (sidecar_socket, client_socket) = UnixStream::pair().unwrap();
    let regions = Regions::create(&config).unwrap();
    send_with_fds(&sidecar_socket, b"attached", &regions.fds())
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let (n, fds) = recv_with_fds(&client_socket, &mut buf).await.unwrap();
    assert_eq!(&buf[..n], b"attached");
    assert_eq!(fds.len(), binx_shm::PASSED_FDS);
    let farewell: binx_shm::stream::Farewell =
        Box::new(|fault: &str| format!("farewell: {fault}").into_bytes());
    let sidecar = serve(regions, sidecar_socket, config.spin, Some(farewell)).unwrap();
    let client = attach(fds, client_socket, config.spin).unwrap();
    (sidecar, client)
}

fn small() -> ShmConfig {
    ShmConfig {
        region_size: 256 << 10,
        slot_size: 16 << 10,
        spin: Duration::from_micros(20),
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_go_both_ways_intact_through_far_more_data_than_the_region_holds() {
    let ((mut s_read, mut s_write, _s), (mut c_read, mut c_write, _c)) = pair(small()).await;
    // 8 MiB each way through regions of 256 KiB: slots are recycled many times
    // and the writer waits for slots (backpressure) again and again.
    let data = pattern(8 << 20, 7);
    let echo = tokio::spawn(async move {
        let mut buf = vec![0u8; 100_000];
        loop {
            let n = s_read.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            s_write.write_all(&buf[..n]).await.unwrap();
            s_write.flush().await.unwrap();
        }
        s_write.shutdown().await.unwrap();
    });
    let to_send = data.clone();
    let sender = tokio::spawn(async move {
        for chunk in to_send.chunks(77_777) {
            c_write.write_all(chunk).await.unwrap();
        }
        c_write.flush().await.unwrap();
        c_write
    });
    let mut back = vec![0u8; data.len()];
    c_read.read_exact(&mut back).await.unwrap();
    assert!(back == data, "the echoed stream differs from what was sent");
    let c_write = sender.await.unwrap();
    drop(c_write);
    drop(c_read);
    // The client is gone: the sidecar's reader sees the end of the stream.
    tokio::time::timeout(Duration::from_secs(5), echo)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_scribbles_over_the_ring_gets_an_error_and_the_sidecar_nothing_worse() {
    let ((mut s_read, s_write, _s), (mut c_read, mut c_write, client)) = pair(small()).await;
    c_write.write_all(b"hello").await.unwrap();
    c_write.flush().await.unwrap();
    let mut buf = [0u8; 5];
    s_read.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"hello");
    // The client's outbound region is the sidecar's inbound one.
    client
        .outbound_region()
        .scribble(SUBMIT_HEAD_AT, &(1u64 << 50).to_ne_bytes());
    let error = tokio::time::timeout(Duration::from_secs(5), s_read.read(&mut [0u8; 16]))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
    assert!(error.to_string().contains("submit ring head"), "{error}");
    // The sidecar closes the connection; the client reads why, from the
    // socket, once its ring is drained.
    drop((s_read, s_write));
    let mut words = String::new();
    tokio::time::timeout(Duration::from_secs(5), c_read.read_to_string(&mut words))
        .await
        .unwrap()
        .unwrap();
    assert!(
        words.starts_with("farewell: shared memory ring: submit ring head"),
        "{words}"
    );
}

/// A sidecar that gives up on a broken client in the middle of a frame it
/// was writing says why on the socket; those words are never read as the
/// rest of that frame (they would end its last page with their bytes),
/// through either way of reading the ring.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn final_words_after_a_frame_cut_short_are_an_error_not_its_end() {
    for in_runs in [false, true] {
        let ((mut s_read, mut s_write, _s), (mut c_read, mut c_write, client)) =
            pair(small()).await;
        // A frame of 4 + 100 bytes, of which the sidecar writes 4 + 50.
        let mut head = 100u32.to_be_bytes().to_vec();
        head.extend(pattern(50, 3));
        s_write.write_all(&head).await.unwrap();
        s_write.flush().await.unwrap();
        c_write.write_all(b"x").await.unwrap();
        c_write.flush().await.unwrap();
        s_read.read_exact(&mut [0u8; 1]).await.unwrap();
        client
            .outbound_region()
            .scribble(SUBMIT_HEAD_AT, &(1u64 << 50).to_ne_bytes());
        let fault = tokio::time::timeout(Duration::from_secs(5), s_read.read(&mut [0u8; 16]))
            .await
            .unwrap();
        assert!(fault.is_err(), "the sidecar sees the broken ring");
        drop((s_read, s_write));
        let error = if in_runs {
            let mut got = Vec::new();
            loop {
                match tokio::time::timeout(Duration::from_secs(5), c_read.next_run_async())
                    .await
                    .unwrap()
                {
                    Ok(Some(run)) => got.extend_from_slice(&run),
                    Ok(None) => panic!("the stream ended cleanly after {} bytes", got.len()),
                    Err(e) => break (got, e),
                }
            }
        } else {
            let mut got = vec![0u8; head.len()];
            c_read.read_exact(&mut got).await.unwrap();
            let mut more = [0u8; 256];
            let e = tokio::time::timeout(Duration::from_secs(5), c_read.read(&mut more))
                .await
                .unwrap()
                .expect_err("no more bytes of the frame");
            (got, e)
        };
        let (got, error) = error;
        assert_eq!(
            got, head,
            "runs: {in_runs}: only what the sidecar wrote of the frame"
        );
        assert_eq!(error.kind(), std::io::ErrorKind::UnexpectedEof, "{error}");
        let text = error.to_string();
        assert!(
            text.contains("middle of a frame") && text.contains("farewell: shared memory ring"),
            "runs: {in_runs}: {text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_reader_is_woken_by_a_submit_and_by_a_hang_up() {
    let ((mut s_read, _s_write, sidecar), (_c_read, mut c_write, _c)) = pair(small()).await;
    let reader = tokio::spawn(async move {
        let mut buf = [0u8; 4];
        s_read.read_exact(&mut buf).await.unwrap();
        let after = s_read.read(&mut [0u8; 4]).await.unwrap();
        (buf, after)
    });
    // Long past the spin: the reader is parked on its eventfd.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!sidecar.is_hung_up());
    c_write.write_all(b"ping").await.unwrap();
    c_write.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(c_write);
    drop(_c_read);
    let (buf, after) = tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&buf, b"ping");
    assert_eq!(after, 0, "the client's hang-up ends the stream");
}

/// Frames from the sidecar, read by the client in place while it keeps many
/// of them alive and drops them out of order: every body arrives intact,
/// frames that fit a slot are not copied, and the client never holds more
/// than half the slots, so the sidecar always has room to write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_are_read_in_place_and_kept_pages_never_hold_the_sidecar_back() {
    use binx_proto::{BinReply, BinRequest, FrameAssembler, MessageType, OutFrame, Status};
    let config = ShmConfig {
        region_size: 2 << 20,
        slot_size: 128 << 10,
        spin: Duration::from_micros(20),
    };
    let ((s_read, mut s_write, _s), (mut c_read, _c_write, client)) = pair(config).await;
    let slots = client.layout().slot_count;
    // Bodies that fit a slot and are worth reading in place, small ones
    // (copied), and ones larger than a slot (copied together).
    let sizes = [100_000usize, 30, 90_000, 200_000, 5_000, 120_000, 70_000, 0];
    let frames = 400u64;
    let size_of = move |i: u64| sizes[i as usize % sizes.len()];
    let fits = move |i: u64| (64 << 10..=120_000).contains(&size_of(i));
    let writer = tokio::spawn(async move {
        let mut scratch = bytes::BytesMut::new();
        // Four frames per write and flush, as binxd batches replies: the
        // writer itself must start a frame in a fresh slot when it would
        // not fit in the rest of the current one.
        for batch in (0..frames).collect::<Vec<_>>().chunks(4) {
            let out = batch.iter().map(|&i| {
                let mut header = BinReply::to(&BinRequest::new(MessageType::Data), Status::Ok);
                header.request_id = i + 1;
                let body = bytes::Bytes::from(pattern(size_of(i), i));
                OutFrame {
                    header,
                    body: vec![body],
                }
            });
            binx_proto::write_frames(&mut s_write, out, &mut scratch)
                .await
                .unwrap();
        }
        // The sidecar hangs up: the client reads to the end of the stream.
        s_write.shutdown().await.unwrap();
        drop((s_read, s_write));
    });
    let mut assembler = FrameAssembler::<BinReply>::new(1 << 20);
    let mut kept = std::collections::VecDeque::new();
    let mut next_id = 1;
    let mut most_pinned = 0;
    let mut read_in_place = 0u64;
    let read = async {
        while let Some(run) = c_read.next_run_async().await.unwrap() {
            assembler.push(run);
            while let Some(frame) = assembler.next_frame().unwrap() {
                let i = frame.header.request_id - 1;
                assert_eq!(frame.header.request_id, next_id);
                next_id += 1;
                assert!(frame.body == pattern(size_of(i), i), "frame {i} differs");
                if fits(i) && i < frames / 2 && client.holds_in_place(&frame.body) {
                    read_in_place += 1;
                }
                kept.push_back(frame);
                // First a few frames kept at once, then more than half the
                // slots could hold; dropped from the middle.
                let keep = if i < frames / 2 { 3 } else { slots };
                while kept.len() > keep {
                    let at = (i as usize * 7) % kept.len();
                    kept.remove(at);
                }
                most_pinned = most_pinned.max(client.slots_pinned());
            }
        }
    };
    if tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .is_err()
    {
        panic!(
            "the sidecar was held back: frame {next_id} of {frames}, {} of {slots} slots pinned, {} frames kept",
            client.slots_pinned(),
            kept.len()
        );
    }
    assembler.finish().unwrap();
    assert_eq!(next_id, frames + 1);
    let (_, copied) = assembler.counts();
    // While few are kept, every frame that fits a slot is read in place.
    let fit = (0..frames / 2).filter(|&i| fits(i)).count() as u64;
    assert_eq!(read_in_place, fit, "frames read in place");
    let spanning = (0..frames).filter(|&i| size_of(i) > 128 << 10).count() as u64;
    assert!(
        copied >= spanning,
        "{copied} frames copied together, {spanning} span slots"
    );
    assert!(
        most_pinned <= slots / 2,
        "{most_pinned} of {slots} slots pinned"
    );
    assert!(most_pinned > 0);
    drop(kept);
    assert_eq!(client.slots_pinned(), 0);
    writer.await.unwrap();
}
