//! The BinX byte stream over a pair of regions: [`ShmReader`] is an
//! `AsyncRead` over the inbound region, [`ShmWriter`] an `AsyncWrite` over
//! the outbound one, so the frame reader and writer of a socket run over
//! shared memory unchanged. The client may instead take whole runs with
//! [`ShmReader::poll_next_run`], read in place in the slots, and the
//! sidecar's writer places frames so that one that fits a slot lies in one
//! run.
//!
//! Wake-ups: a side that finds nothing to do spins for `spin`, then sets its
//! waiting flag in the region, checks once more and parks on its eventfd.
//! The other side writes that eventfd only when the flag is set, so while
//! both are busy no system call is made. A writer notifies once per
//! submitted slot (a flush submits the partly filled one), which makes one
//! notification per batch of frames.
//!
//! A watcher task reads the socket: when the peer closes it (or dies), both
//! halves are woken and end; what the sidecar writes on the socket before it
//! closes (one final error frame) is read out after the ring is drained.

use std::future::Future;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rustix::event::EventfdFlags;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::UnixStream;
use tokio::sync::Notify;

use crate::layout::Layout;
use crate::mapping::Mapping;
use crate::ring::{Descriptor, Lease, SlotReader, SlotWriter};
use crate::{PASSED_FDS, ShmConfig, ShmError};

/// Bytes of a final message the sidecar may write on the socket, at most.
const FAREWELL_LIMIT: usize = 64 * 1024;

/// The regions and eventfds of one connection, made by the sidecar.
pub struct Regions {
    to_sidecar: Mapping,
    to_client: Mapping,
    /// Submit and complete eventfds of `to_sidecar`, then of `to_client`.
    events: [OwnedFd; 4],
}

impl Regions {
    /// Creates both regions with the geometry `config` gives, and the four
    /// eventfds.
    pub fn create(config: &ShmConfig) -> Result<Regions, ShmError> {
        let layout = Layout::new(config.region_size, config.slot_size)?;
        let event = || {
            rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
                .map_err(|e| ShmError::Sys("eventfd", e.into()))
        };
        Ok(Regions {
            to_sidecar: Mapping::create("binx-to-sidecar", layout)?,
            to_client: Mapping::create("binx-to-client", layout)?,
            events: [event()?, event()?, event()?, event()?],
        })
    }

    /// The descriptors to pass, in the order of [`PASSED_FDS`].
    pub fn fds(&self) -> [BorrowedFd<'_>; PASSED_FDS] {
        let [a, b, c, d] = &self.events;
        [
            self.to_sidecar.fd().as_fd(),
            self.to_client.fd().as_fd(),
            a.as_fd(),
            b.as_fd(),
            c.as_fd(),
            d.as_fd(),
        ]
    }

    /// The geometry both regions share.
    pub fn layout(&self) -> &Layout {
        self.to_sidecar.layout()
    }
}

/// Turns a fault into the bytes to write on the socket before closing it.
pub type Farewell = Box<dyn Fn(&str) -> Vec<u8> + Send + Sync>;

/// The region this side reads, with its reading state. Pages read in place
/// keep only this alive (not the socket, the other region or the other
/// eventfds), and complete their slots through it when dropped, on
/// whatever thread that is.
struct Inbound {
    region: Mapping,
    reader: Mutex<SlotReader>,
    /// We write it after completing a slot while the peer's writer is
    /// parked.
    complete_event: OwnedFd,
    /// Slots held by runs read in place.
    pinned: AtomicUsize,
}

impl Inbound {
    /// Returns a slot to the peer's writer, waking it if it waits for one.
    fn complete(&self, d: Descriptor) {
        lock(&self.reader).complete(&self.region, d);
        if SlotReader::writer_parked(&self.region) {
            notify(&self.complete_event);
        }
    }

    fn next(&self) -> Result<Option<Descriptor>, ShmError> {
        lock(&self.reader).next(&self.region)
    }

    fn has_next(&self) -> bool {
        lock(&self.reader).has_next(&self.region)
    }
}

/// What both halves of one side share: the regions, the eventfds, the socket.
pub struct Link {
    inbound: Arc<Inbound>,
    outbound: Mapping,
    /// We write it after submitting an outbound slot while the peer's reader
    /// is parked.
    outbound_submit: OwnedFd,
    /// Our own waits, kept to wake them when the socket closes.
    inbound_submit_raw: Arc<AsyncFd<OwnedFd>>,
    outbound_complete_raw: Arc<AsyncFd<OwnedFd>>,
    socket: UnixStream,
    spin: Duration,
    hung_up: AtomicBool,
    /// What the sidecar wrote on the socket before closing it (client side).
    last_words: Mutex<Vec<u8>>,
    /// Set by the sidecar's watcher when the client breaks the rules on the
    /// socket itself.
    violation: Mutex<Option<String>>,
    /// Why this side gave up on the rings, if it did.
    fault: Mutex<Option<String>>,
    /// Encodes the message written on the socket after a fault, before it is
    /// closed (the sidecar's final error frame).
    farewell: Option<Farewell>,
    /// Halves still alive; the watcher stops with the last.
    halves: AtomicUsize,
    closed: Notify,
    is_sidecar: bool,
}

impl Link {
    /// Whether the socket is done with: the peer closed it or died, or (on
    /// the sidecar) the client wrote on it, which the rings forbid.
    pub fn is_hung_up(&self) -> bool {
        self.hung_up.load(Ordering::Acquire)
    }

    /// The geometry of the inbound region (both regions share it).
    pub fn layout(&self) -> &Layout {
        self.inbound.region.layout()
    }

    /// The inbound region, for tests that play a misbehaving peer.
    #[doc(hidden)]
    pub fn inbound_region(&self) -> &Mapping {
        &self.inbound.region
    }

    /// The outbound region, for tests that play a misbehaving peer.
    #[doc(hidden)]
    pub fn outbound_region(&self) -> &Mapping {
        &self.outbound
    }

    /// Whether `bytes` lie in the inbound region: read in place, not copied.
    pub fn holds_in_place(&self, bytes: &[u8]) -> bool {
        self.inbound.region.contains(bytes)
    }

    /// Inbound slots held by runs read in place (client side).
    pub fn slots_pinned(&self) -> usize {
        self.inbound.pinned.load(Ordering::Relaxed)
    }

    fn record_fault(&self, fault: &str) {
        lock(&self.fault).get_or_insert_with(|| fault.to_string());
    }

    /// Writes `bytes` on the socket (the sidecar's final error frame), within
    /// `timeout`: the rings may be what the client broke.
    async fn say_on_socket(&self, bytes: &[u8], timeout: Duration) {
        let write = async {
            let mut sent = 0;
            while sent < bytes.len() {
                if self.socket.writable().await.is_err() {
                    return;
                }
                match self.socket.try_write(&bytes[sent..]) {
                    Ok(n) => sent += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    Err(_) => return,
                }
            }
        };
        let _ = tokio::time::timeout(timeout, write).await;
    }

    fn hang_up(&self) {
        self.hung_up.store(true, Ordering::Release);
        for fd in [&self.inbound_submit_raw, &self.outbound_complete_raw] {
            notify(fd.get_ref());
        }
    }

    fn half_dropped(&self) {
        if self.halves.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.closed.notify_one();
        }
    }

    /// Reads the socket until the peer closes it or both halves are gone.
    async fn watch(self: Arc<Self>) {
        let mut buf = vec![0u8; 4096];
        loop {
            tokio::select! {
                ready = self.socket.readable() => {
                    if ready.is_err() {
                        self.hang_up();
                        return;
                    }
                }
                _ = self.closed.notified() => {
                    // Both halves are gone: say why if this side gave up,
                    // then close the socket even if someone keeps the link.
                    let fault = lock(&self.fault).clone();
                    if let (Some(fault), Some(farewell)) = (fault, &self.farewell) {
                        self.say_on_socket(&farewell(&fault), Duration::from_secs(1)).await;
                    }
                    let _ = rustix::net::shutdown(&self.socket, rustix::net::Shutdown::Both);
                    return;
                }
            }
            match self.socket.try_read(&mut buf) {
                Ok(0) => {
                    self.hang_up();
                    return;
                }
                Ok(n) if self.is_sidecar => {
                    *lock(&self.violation) = Some(format!(
                        "the client wrote {n} bytes on its Unix socket after attaching shared memory; frames go through the regions"
                    ));
                    self.hang_up();
                    return;
                }
                Ok(n) => {
                    let mut words = lock(&self.last_words);
                    let room = FAREWELL_LIMIT.saturating_sub(words.len());
                    words.extend_from_slice(&buf[..n.min(room)]);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(_) => {
                    self.hang_up();
                    return;
                }
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Adds one to an eventfd; a full counter already means "wake up". The
/// peer holds the same open file, so it can clear the O_NONBLOCK this side
/// set and fill the counter: then a write would wait, on a runtime thread,
/// until the peer reads. So the write is made only while the counter has
/// room (POLLOUT). Left: a peer that fills the counter between that check
/// and the write (docs/SECURITY.md).
fn notify(fd: &OwnedFd) {
    let mut room = [rustix::event::PollFd::new(
        fd,
        rustix::event::PollFlags::OUT,
    )];
    let now = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match rustix::event::poll(&mut room, Some(&now)) {
        Ok(1) if room[0].revents().contains(rustix::event::PollFlags::OUT) => {
            let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
        }
        // Full (the peer has a wake-up waiting), or the peer is gone.
        _ => {}
    }
}

fn waiter(fd: OwnedFd) -> Result<Arc<AsyncFd<OwnedFd>>, ShmError> {
    // Safety: the OwnedFd is open and owned by the AsyncFd for its lifetime.
    unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
        .map(Arc::new)
        .map_err(|e| ShmError::Sys("registering an eventfd", io::Error::other(e.to_string())))
}

/// Waits on an eventfd: `Ready` once it was written since the last `Ready`,
/// `Pending` with the waker registered otherwise. The count is never read:
/// the peer holds the same open file and can clear its O_NONBLOCK, and a
/// read of an empty count would then wait on a runtime thread. The
/// runtime's edge-triggered readiness tells each write instead (a
/// readiness cleared here is not cleared if a write came after it was
/// seen), and the count itself means nothing (2^64 writes to fill it).
fn poll_event(fd: &AsyncFd<OwnedFd>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
    let mut guard = ready!(fd.poll_read_ready(cx))?;
    guard.clear_ready();
    Poll::Ready(Ok(()))
}

/// Busy polling before parking. While it lasts, a side with nothing to do
/// wakes its own task at once and returns `Pending`, so other tasks on the
/// same thread (the other half, request handling) run in between: spinning
/// inside `poll` would hold them up for the whole spin.
#[derive(Default)]
struct Spin {
    until: Option<Instant>,
}

impl Spin {
    /// True while the spin lasts (the task is already woken again).
    fn keep_polling(&mut self, spin: Duration, cx: &mut Context<'_>) -> bool {
        if spin.is_zero() {
            return false;
        }
        let now = Instant::now();
        let until = *self.until.get_or_insert(now + spin);
        if now < until {
            // As `yield_now` does: the task is woken after the runtime has
            // looked at its I/O and other tasks, not ahead of them (a plain
            // self-wake would be polled again first, and would keep the
            // runtime from checking I/O while the spin lasts).
            let _ = std::pin::pin!(tokio::task::yield_now()).poll(cx);
            return true;
        }
        false
    }

    /// There was work: the next idle stretch spins again.
    fn reset(&mut self) {
        self.until = None;
    }
}

/// The sidecar's side: reads what the client sends, writes replies.
/// `farewell` encodes what to write on the socket when the client broke the
/// rings.
pub fn serve(
    regions: Regions,
    socket: UnixStream,
    spin: Duration,
    farewell: Option<Farewell>,
) -> Result<(ShmReader, ShmWriter, Arc<Link>), ShmError> {
    let [
        to_sidecar_submit,
        to_sidecar_complete,
        to_client_submit,
        to_client_complete,
    ] = regions.events;
    join(
        true,
        regions.to_sidecar,
        regions.to_client,
        [
            to_sidecar_submit,
            to_sidecar_complete,
            to_client_submit,
            to_client_complete,
        ],
        socket,
        spin,
        farewell,
    )
}

/// The client's side, from the descriptors received with the attach reply.
pub fn attach(
    fds: Vec<OwnedFd>,
    socket: UnixStream,
    spin: Duration,
) -> Result<(ShmReader, ShmWriter, Arc<Link>), ShmError> {
    let Ok([to_sidecar, to_client, a, b, c, d]) = <[OwnedFd; PASSED_FDS]>::try_from(fds) else {
        return Err(ShmError::Passing(format!(
            "the attach reply did not carry exactly {PASSED_FDS} descriptors"
        )));
    };
    let to_sidecar = Mapping::open(to_sidecar)?;
    let to_client = Mapping::open(to_client)?;
    // The client reads `to_client` and writes `to_sidecar`.
    join(
        false,
        to_client,
        to_sidecar,
        [c, d, a, b],
        socket,
        spin,
        None,
    )
}

/// `events`: inbound submit, inbound complete, outbound submit, outbound
/// complete.
/// `is_sidecar` decides what this side trusts: the sidecar reads what the
/// client wrote only through `pread` and never hands out views of it.
#[allow(clippy::too_many_arguments)]
fn join(
    is_sidecar: bool,
    inbound: Mapping,
    outbound: Mapping,
    events: [OwnedFd; 4],
    socket: UnixStream,
    spin: Duration,
    farewell: Option<Farewell>,
) -> Result<(ShmReader, ShmWriter, Arc<Link>), ShmError> {
    let [
        inbound_submit,
        inbound_complete,
        outbound_submit,
        outbound_complete,
    ] = events;
    let reader_state = SlotReader::new(&inbound);
    let writer_state = SlotWriter::new(&outbound);
    let inbound_submit = waiter(inbound_submit)?;
    let outbound_complete = waiter(outbound_complete)?;
    let link = Arc::new(Link {
        inbound: Arc::new(Inbound {
            region: inbound,
            reader: Mutex::new(reader_state),
            complete_event: inbound_complete,
            pinned: AtomicUsize::new(0),
        }),
        outbound,
        outbound_submit,
        inbound_submit_raw: inbound_submit.clone(),
        outbound_complete_raw: outbound_complete.clone(),
        socket,
        spin,
        hung_up: AtomicBool::new(false),
        last_words: Mutex::new(Vec::new()),
        violation: Mutex::new(None),
        fault: Mutex::new(None),
        farewell,
        halves: AtomicUsize::new(2),
        closed: Notify::new(),
        is_sidecar,
    });
    tokio::spawn(link.clone().watch());
    let reader = ShmReader {
        link: link.clone(),
        wake: inbound_submit,
        current: None,
        parked: false,
        spin: Spin::default(),
        farewell_read: 0,
        cursor: FrameCursor::default(),
    };
    let writer = ShmWriter {
        link: link.clone(),
        state: writer_state,
        wake: outbound_complete,
        current: None,
        parked: false,
        spin: Spin::default(),
        cursor: FrameCursor::default(),
    };
    Ok((reader, writer, link))
}

/// `AsyncRead` over the inbound region.
pub struct ShmReader {
    link: Arc<Link>,
    wake: Arc<AsyncFd<OwnedFd>>,
    /// The descriptor being read and how much of it was read.
    current: Option<(Descriptor, u32)>,
    parked: bool,
    spin: Spin,
    farewell_read: usize,
    /// Where the stream read so far is relative to its frames: the
    /// sidecar's final words are a frame of their own, never the end of
    /// one it left unfinished.
    cursor: FrameCursor,
}

/// Runs shorter than this are copied even when they could be read in
/// place: a small copy costs less than a whole slot held for it.
pub const MIN_IN_PLACE: usize = 64 * 1024;

/// A run of stream bytes read where the sidecar wrote it. Its slot goes
/// back to the sidecar when the last `Bytes` made from it is dropped.
struct SlotRun {
    inbound: Arc<Inbound>,
    descriptor: Descriptor,
    offset: usize,
    len: usize,
}

impl AsRef<[u8]> for SlotRun {
    fn as_ref(&self) -> &[u8] {
        // Safety: this run holds its slot until it is dropped, and it is
        // made only on the client's side (`ShmReader::next_run`).
        unsafe {
            self.inbound
                .region
                .slot_bytes(self.descriptor.slot as usize, self.offset, self.len)
        }
    }
}

impl Drop for SlotRun {
    fn drop(&mut self) {
        self.inbound.complete(self.descriptor);
        self.inbound.pinned.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ShmReader {
    /// The descriptor being read and how much of it was read, taking the
    /// next one if none is.
    fn current_or_next(&mut self) -> Result<Option<(Descriptor, u32)>, ShmError> {
        if let Some(current) = self.current.take() {
            return Ok(Some(current));
        }
        Ok(self.link.inbound.next()?.map(|d| (d, 0)))
    }

    fn has_next(&self) -> bool {
        self.link.inbound.has_next()
    }

    /// Copies `out.len()` bytes at `offset` of `d`'s slot into `out`: through
    /// the descriptor on the sidecar's side (see `Mapping::pread_slot_uninit`),
    /// through the mapping on the client's. On failure `d` stays current.
    fn copy_out(
        &mut self,
        d: Descriptor,
        used: u32,
        out: &mut [std::mem::MaybeUninit<u8>],
    ) -> Result<(), ShmError> {
        let region = &self.link.inbound.region;
        let (slot, offset) = (d.slot as usize, (d.offset + used) as usize);
        if self.link.is_sidecar {
            if let Err(e) = region.pread_slot_uninit(slot, offset, out) {
                self.current = Some((d, used));
                return Err(ShmError::Sys("reading a slot of region A", e));
            }
        } else {
            region.read_slot_uninit(slot, offset, out);
        }
        Ok(())
    }

    /// Copies whatever is available into `buf`; true if anything was.
    fn copy_available(&mut self, buf: &mut ReadBuf<'_>) -> Result<bool, ShmError> {
        let mut copied = false;
        while buf.remaining() > 0 {
            let Some((d, used)) = self.current_or_next()? else {
                break;
            };
            let n = (d.length - used).min(buf.remaining() as u32);
            // Safety: only written here, never read; `assume_init` covers
            // exactly the bytes the copy wrote (all of them, or it failed).
            unsafe {
                self.copy_out(d, used, &mut buf.unfilled_mut()[..n as usize])?;
                buf.assume_init(n as usize);
            }
            let at = buf.filled().len();
            buf.advance(n as usize);
            self.cursor.advance(&buf.filled()[at..]);
            copied = true;
            if used + n == d.length {
                self.link.inbound.complete(d);
            } else {
                self.current = Some((d, used + n));
            }
        }
        Ok(copied)
    }

    /// The rest of the next descriptor as one run: in place (client side, a
    /// run of at least [`MIN_IN_PLACE`] bytes, while fewer than half the
    /// slots are held so) or else copied, its slot completed at once.
    /// Holding at most half the slots leaves the sidecar room to write
    /// whatever pages the engine keeps.
    fn next_run(&mut self) -> Result<Option<Bytes>, ShmError> {
        let Some((d, used)) = self.current_or_next()? else {
            return Ok(None);
        };
        let inbound = self.link.inbound.clone();
        let (offset, len) = ((d.offset + used) as usize, (d.length - used) as usize);
        let cap = inbound.region.layout().slot_count / 2;
        if !self.link.is_sidecar
            && len >= MIN_IN_PLACE
            && inbound.pinned.load(Ordering::Relaxed) < cap
        {
            inbound.pinned.fetch_add(1, Ordering::Relaxed);
            let run = Bytes::from_owner(SlotRun {
                inbound,
                descriptor: d,
                offset,
                len,
            });
            self.cursor.advance(&run);
            return Ok(Some(run));
        }
        let mut copy = Vec::with_capacity(len);
        self.copy_out(d, used, &mut copy.spare_capacity_mut()[..len])?;
        // Safety: the first `len` bytes were just written by the copy.
        unsafe { copy.set_len(len) };
        inbound.complete(d);
        self.cursor.advance(&copy);
        Ok(Some(Bytes::from(copy)))
    }

    /// After the peer hung up and the ring is drained: the sidecar's final
    /// words (client side), a violation (sidecar side), or end of stream.
    fn after_hang_up(&mut self, buf: &mut ReadBuf<'_>) -> io::Result<()> {
        let rest = self.last_words()?;
        let n = rest.len().min(buf.remaining());
        buf.put_slice(&rest[..n]);
        self.farewell_read += n;
        Ok(())
    }

    /// What the sidecar wrote on the socket and was not read yet. Words
    /// after a frame the ring left unfinished are an error that quotes
    /// them: handed on, they would complete that frame with their bytes.
    fn last_words(&self) -> io::Result<Vec<u8>> {
        if let Some(violation) = lock(&self.link.violation).clone() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, violation));
        }
        let words = lock(&self.link.last_words);
        if self.farewell_read == 0 && !words.is_empty() && !self.cursor.at_boundary() {
            let quoted = String::from_utf8_lossy(&words[..words.len().min(512)]);
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "the sidecar ended the shared memory stream in the middle of a frame, then wrote on the socket: {quoted:?}"
                ),
            ));
        }
        Ok(words[self.farewell_read.min(words.len())..].to_vec())
    }

    /// Waits until `take` finds something, spinning then parking; `None`
    /// once the peer has hung up and the ring is drained.
    fn poll_until<T>(
        &mut self,
        cx: &mut Context<'_>,
        take: &mut dyn FnMut(&mut Self) -> Result<Option<T>, ShmError>,
    ) -> Poll<io::Result<Option<T>>> {
        let link = self.link.clone();
        let region = &link.inbound.region;
        if self.parked {
            SlotReader::park(region, false);
            self.parked = false;
        }
        loop {
            match take(self) {
                Ok(Some(found)) => {
                    self.spin.reset();
                    return Poll::Ready(Ok(Some(found)));
                }
                Ok(None) => {}
                Err(e) => {
                    link.record_fault(&e.to_string());
                    return Poll::Ready(Err(e.into()));
                }
            }
            if link.is_hung_up() {
                // The flag is set after the peer's last submit could have
                // landed; one more look drains it.
                if self.has_next() {
                    continue;
                }
                return Poll::Ready(Ok(None));
            }
            if self.spin.keep_polling(link.spin, cx) {
                return Poll::Pending;
            }
            SlotReader::park(region, true);
            self.parked = true;
            if self.has_next() || link.is_hung_up() {
                continue;
            }
            match poll_event(&self.wake, cx) {
                Poll::Ready(Ok(())) => continue,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// The next run of the stream, whole (as `ShmReader::next_run` reads it):
    /// runs that hold whole frames let the frames be decoded in place.
    /// `None` at the end of the stream; the sidecar's final words, if it
    /// wrote any on the socket, come as a last run before it.
    pub fn poll_next_run(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Option<Bytes>>> {
        match ready!(self.poll_until(cx, &mut |this| this.next_run())) {
            Ok(Some(run)) => Poll::Ready(Ok(Some(run))),
            Ok(None) => {
                let rest = self.last_words()?;
                self.farewell_read += rest.len();
                Poll::Ready(Ok((!rest.is_empty()).then(|| Bytes::from(rest))))
            }
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    /// [`ShmReader::poll_next_run`] as a future.
    pub async fn next_run_async(&mut self) -> io::Result<Option<Bytes>> {
        std::future::poll_fn(|cx| self.poll_next_run(cx)).await
    }
}

impl AsyncRead for ShmReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let found =
            ready!(this.poll_until(cx, &mut |this| Ok(this.copy_available(buf)?.then_some(()))));
        Poll::Ready(match found {
            Ok(Some(())) => Ok(()),
            Ok(None) => this.after_hang_up(buf),
            Err(e) => Err(e),
        })
    }
}

impl Drop for ShmReader {
    fn drop(&mut self) {
        self.link.half_dropped();
    }
}

/// `AsyncWrite` over the outbound region.
pub struct ShmWriter {
    link: Arc<Link>,
    state: SlotWriter,
    wake: Arc<AsyncFd<OwnedFd>>,
    /// The slot being filled and how much of it is filled.
    current: Option<(Lease, u32)>,
    parked: bool,
    spin: Spin,
    /// Where the stream is relative to its frames (sidecar side).
    cursor: FrameCursor,
}

/// Tracks frame boundaries in a BinX stream from the frames' `length`
/// fields. Writing, so the sidecar can start a frame in a fresh slot when
/// it would not fit in the rest of the current one: a frame that lies in
/// one slot is read by the client in place, with no copy (the bytes sent
/// are the same; only where slots end changes). Reading, so the client
/// knows whether the ring ended between frames.
#[derive(Debug, Default)]
struct FrameCursor {
    /// Bytes of the current frame after its length field still to come.
    left: usize,
    /// The length field being written, and how much of it was.
    length: [u8; 4],
    have: usize,
}

impl FrameCursor {
    /// The whole size of a frame whose first byte `data` starts with, when
    /// `data` holds its length field.
    fn frame_starting(&self, data: &[u8]) -> Option<usize> {
        match data {
            [a, b, c, d, ..] if self.left == 0 && self.have == 0 => {
                Some(4 + u32::from_be_bytes([*a, *b, *c, *d]) as usize)
            }
            _ => None,
        }
    }

    /// Bytes of `data` up to the end of the frame it is in, when known.
    fn frame_end(&self, data: &[u8]) -> Option<usize> {
        if self.left > 0 {
            return Some(self.left);
        }
        self.frame_starting(data)
    }

    /// Whether the stream so far ends where a frame does.
    fn at_boundary(&self) -> bool {
        self.left == 0 && self.have == 0
    }

    /// Moves past `data`, written or read.
    fn advance(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            if self.left > 0 {
                let n = self.left.min(data.len());
                self.left -= n;
                data = &data[n..];
                continue;
            }
            let n = (4 - self.have).min(data.len());
            self.length[self.have..self.have + n].copy_from_slice(&data[..n]);
            self.have += n;
            data = &data[n..];
            if self.have == 4 {
                self.left = u32::from_be_bytes(self.length) as usize;
                self.have = 0;
            }
        }
    }
}

impl ShmWriter {
    fn submit_current(&mut self) {
        let region = &self.link.outbound;
        match self.current.take() {
            Some((lease, 0)) => self.state.release(lease),
            Some((lease, filled)) => {
                self.state.submit(region, lease, 0, filled);
                if SlotWriter::reader_parked(region) {
                    notify(&self.link.outbound_submit);
                }
            }
            None => {}
        }
    }

    /// Copies as much of `data` as fits in the current slot (taking a free
    /// one first, or waiting for one).
    fn poll_write_some(&mut self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let link = self.link.clone();
        let region = &link.outbound;
        if self.parked {
            SlotWriter::park(region, false);
            self.parked = false;
        }
        let slot_size = region.layout().slot_size;
        if let (true, Some((_, filled)), Some(frame)) = (
            link.is_sidecar,
            self.current,
            self.cursor.frame_starting(data),
        ) && filled > 0
            && frame <= slot_size
            && frame > slot_size - filled as usize
        {
            self.submit_current();
        }
        let (lease, filled) = loop {
            if link.is_hung_up() {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "the peer closed the shared memory connection",
                )));
            }
            if let Some(current) = self.current {
                break current;
            }
            match self.state.acquire(region) {
                Ok(Some(lease)) => {
                    self.spin.reset();
                    self.current = Some((lease, 0));
                    continue;
                }
                Ok(None) => {}
                Err(e) => {
                    link.record_fault(&e.to_string());
                    return Poll::Ready(Err(e.into()));
                }
            }
            if self.spin.keep_polling(link.spin, cx) {
                return Poll::Pending;
            }
            SlotWriter::park(region, true);
            self.parked = true;
            if self.state.completions_waiting(region) || link.is_hung_up() {
                continue;
            }
            ready!(poll_event(&self.wake, cx))?;
        };
        let slot_size = slot_size as u32;
        // The sidecar stops at the end of a frame, so the next write starts
        // at the next frame's length field and can be placed by it.
        let data = match self.cursor.frame_end(data) {
            Some(end) if link.is_sidecar && end < data.len() => &data[..end],
            _ => data,
        };
        let n = (slot_size - filled).min(data.len() as u32);
        region.write_slot(lease.slot as usize, filled as usize, &data[..n as usize]);
        self.cursor.advance(&data[..n as usize]);
        self.current = Some((lease, filled + n));
        if filled + n == slot_size {
            self.submit_current();
        }
        Poll::Ready(Ok(n as usize))
    }
}

impl AsyncWrite for ShmWriter {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_some(cx, data)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let mut total = 0;
        for buf in bufs {
            let mut at = 0;
            while at < buf.len() {
                match this.poll_write_some(cx, &buf[at..]) {
                    Poll::Ready(Ok(n)) => {
                        at += n;
                        total += n;
                    }
                    Poll::Ready(Err(e)) if total == 0 => return Poll::Ready(Err(e)),
                    Poll::Pending if total == 0 => return Poll::Pending,
                    _ => return Poll::Ready(Ok(total)),
                }
            }
        }
        Poll::Ready(Ok(total))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.link.is_hung_up() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the peer closed the shared memory connection",
            )));
        }
        this.submit_current();
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.submit_current();
        // A client's sidecar learns on the socket that nothing more will
        // come, as from a plain socket's shutdown, and frees the regions
        // instead of waiting for its idle timeout. (The sidecar's own end
        // closes through the watcher, after any farewell.)
        if !this.link.is_sidecar {
            let _ = rustix::net::shutdown(&this.link.socket, rustix::net::Shutdown::Write);
        }
        Poll::Ready(Ok(()))
    }
}

impl Drop for ShmWriter {
    fn drop(&mut self) {
        self.link.half_dropped();
    }
}
