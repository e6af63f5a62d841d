//! The C ABI (include/binx.h): blocking calls over the async client, for
//! engines written in C or C++. Each `binx_client` owns a small tokio
//! runtime; each call runs to completion on it. No panic crosses the
//! boundary: every entry point catches it and returns `BINX_ERR_INTERNAL`.
//!
//! Thread safety: calls on one `binx_client` may come from any number of
//! threads at once; a `binx_source` is used by one thread at a time.
//! `binx_last_error` is per thread.

#![deny(clippy::undocumented_unsafe_blocks)]

mod sigpipe;

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;

use binx_proto::{BufferKind, Status};
use bytes::Bytes;

use binx_client::{
    ClientError, ConnectionOptions, ExchangeSource, Producer, SourceConfig, TaskSpec,
};

/// Status codes of every call (`binx_status` in binx.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinxStatus {
    /// The call succeeded.
    Ok = 0,
    /// A null pointer, invalid UTF-8, or a value out of range.
    InvalidArgument = 1,
    /// The sidecar cannot be reached (or the connection was lost for good).
    Unavailable = 2,
    /// The sidecar refused the request as malformed (BAD_REQUEST).
    BadRequest = 3,
    /// The sidecar failed, or the task was aborted (SERVER_ERROR).
    ServerError = 4,
    /// No room: the request stored nothing; try again later (BUSY).
    Busy = 5,
    /// No reply in time (TIMEOUT).
    Timeout = 6,
    /// The sidecar refused the shared secret, or none was given (UNAUTHENTICATED).
    Unauthenticated = 7,
    /// The caller's buffer is too small for the next page; nothing was consumed.
    BufferTooSmall = 8,
    /// Reserved: not returned by this version.
    Unsupported = 9,
    /// A bug in binx (a caught panic); the message says where.
    Internal = 10,
    /// An enqueue cut into several requests stored its first pages, then
    /// failed: send the pages from the count stored on again, not all.
    Partial = 11,
    /// No page within the source's wait (`binx_source_set_next_wait`);
    /// nothing was consumed, and the source goes on.
    NoPageYet = 12,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn fail(status: BinxStatus, message: impl Into<String>) -> BinxStatus {
    let text = message.into().replace('\0', " ");
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(text).unwrap_or_default());
    status
}

fn client_error(e: ClientError) -> BinxStatus {
    let status = match e.status() {
        Some(Status::BadRequest) => BinxStatus::BadRequest,
        Some(Status::ServerError) => BinxStatus::ServerError,
        Some(Status::Busy) => BinxStatus::Busy,
        Some(Status::Timeout) => BinxStatus::Timeout,
        Some(Status::Unauthenticated) => BinxStatus::Unauthenticated,
        Some(_) => BinxStatus::ServerError,
        None => match &e {
            // Exact only when the request that failed was refused: after a
            // lost connection its pages may or may not have been stored.
            ClientError::PartlyStored { last, .. } if last.status().is_some() => {
                BinxStatus::Partial
            }
            ClientError::Encode { .. } => BinxStatus::InvalidArgument,
            ClientError::DaemonRestarted { .. } => BinxStatus::ServerError,
            ClientError::Timeout { .. } | ClientError::ConnectTimeout { .. } => BinxStatus::Timeout,
            _ => BinxStatus::Unavailable,
        },
    };
    fail(status, e.to_string())
}

/// Runs `f`, turning a panic into `BINX_ERR_INTERNAL`, with SIGPIPE held
/// back on the caller's thread (a write to a closed socket is an error, not
/// the end of the engine's process: `sigpipe`).
fn guard(f: impl FnOnce() -> BinxStatus) -> BinxStatus {
    let _sigpipe = sigpipe::Held::new();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(status) => status,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            fail(
                BinxStatus::Internal,
                format!("internal error in binx: {what}"),
            )
        }
    }
}

/// [`guard`] for a call that reads `source`: a panic ends the source as
/// any error does (binx.h), its state perhaps half changed.
fn source_guard(source: *mut BinxSource, f: impl FnOnce() -> BinxStatus) -> BinxStatus {
    let status = guard(f);
    if status == BinxStatus::Internal
        // SAFETY: a non-null pointer came from binx_source_open; the call's
        // own borrow of it ended with `f`.
        && let Some(source) = unsafe { source.as_mut() }
        && source.failed.is_none()
    {
        let message = LAST_ERROR.with(|e| e.borrow().to_string_lossy().into_owned());
        source.failed = Some((status, message));
    }
    status
}

/// Bytes of `sun_path` on Linux, its terminating NUL included.
const UNIX_PATH_MAX: usize = 108;

/// A C string argument, or why it is unusable.
unsafe fn text<'a>(ptr: *const c_char, what: &str) -> Result<&'a str, BinxStatus> {
    if ptr.is_null() {
        return Err(fail(BinxStatus::InvalidArgument, format!("{what} is NULL")));
    }
    // SAFETY: the caller passes a NUL-terminated string (binx.h).
    unsafe { CStr::from_ptr(ptr) }
        .to_str()
        .map_err(|_| fail(BinxStatus::InvalidArgument, format!("{what} is not UTF-8")))
}

/// A connection to the local sidecar (`binx_client` in binx.h).
pub struct BinxClient {
    runtime: tokio::runtime::Runtime,
    producer: Producer,
}

/// A consumer of one buffer (`binx_source` in binx.h).
pub struct BinxSource {
    client: *const BinxClient,
    source: ExchangeSource,
    /// The next page, not yet delivered (it did not fit the caller's buffer).
    pending: Option<Bytes>,
    /// The page the last borrowed view points into, kept alive until the next call.
    viewed: Option<Bytes>,
    done: bool,
    /// The status and message of the error that ended it: every later
    /// call returns them (the source reads no more).
    failed: Option<(BinxStatus, String)>,
    /// How long a call waits for the next page (`binx_source_set_next_wait`);
    /// `None`: as long as the buffer may still get pages.
    next_wait: Option<std::time::Duration>,
    /// "buffer B of task T", for messages.
    label: String,
}

/// Message of the last failing call on this thread ("" if none). Valid
/// until the next call on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn binx_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Options of `binx_connect` (`binx_options` in binx.h); zero means default.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BinxOptions {
    /// Non-zero asks for the shared-memory transport.
    pub use_shared_memory: c_int,
    /// How long requests are retried while the sidecar is unreachable or
    /// busy before the call fails (0: 3 minutes).
    pub max_error_millis: u32,
}

/// Connects (lazily: the first call connects) to the sidecar's Unix socket.
///
/// # Safety
/// `uds_path` is a NUL-terminated string; `options` is NULL or readable;
/// `out` points to writable memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn binx_connect(
    uds_path: *const c_char,
    options: *const BinxOptions,
    out: *mut *mut BinxClient,
) -> BinxStatus {
    guard(|| {
        if out.is_null() {
            return fail(BinxStatus::InvalidArgument, "out is NULL");
        }
        // SAFETY: the caller passes NULL or a NUL-terminated string (binx.h); `text` checks NULL.
        let path = match unsafe { text(uds_path, "uds_path") } {
            Ok(p) => PathBuf::from(p),
            Err(s) => return s,
        };
        // Connecting is lazy: a path no socket can have is refused now,
        // not retried by every call for max_error_millis.
        let len = path.as_os_str().len();
        if len == 0 || len >= UNIX_PATH_MAX {
            return fail(
                BinxStatus::InvalidArgument,
                format!(
                    "uds_path {:?} has {len} bytes; a Unix socket's path has 1 to {} bytes",
                    binx_proto::truncate(&path.to_string_lossy(), 64),
                    UNIX_PATH_MAX - 1
                ),
            );
        }
        // SAFETY: NULL or a readable binx_options (binx.h).
        let options = unsafe { options.as_ref() }.copied().unwrap_or_default();
        let mut connection_options = ConnectionOptions::default();
        if options.max_error_millis > 0 {
            connection_options.backoff.max_error_duration =
                std::time::Duration::from_millis(u64::from(options.max_error_millis));
        }
        connection_options.shared_memory = options.use_shared_memory != 0;
        let runtime = match tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("binx-client")
            .on_thread_start(sigpipe::block_on_this_thread)
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => return fail(BinxStatus::Internal, format!("cannot start a runtime: {e}")),
        };
        let producer = {
            let _enter = runtime.enter();
            Producer::unix(path, connection_options)
        };
        // SAFETY: checked non-null above.
        unsafe { *out = Box::into_raw(Box::new(BinxClient { runtime, producer })) };
        BinxStatus::Ok
    })
}

/// Closes the client. Sources opened from it must be closed first.
///
/// # Safety
/// `client` came from `binx_connect` and is not used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn binx_close(client: *mut BinxClient) {
    if !client.is_null() {
        // SAFETY: the caller gives up the pointer.
        let client = unsafe { Box::from_raw(client) };
        let _sigpipe = sigpipe::Held::new();
        let _ = catch_unwind(AssertUnwindSafe(move || {
            client.producer.connection().disconnect();
            client
                .runtime
                .shutdown_timeout(std::time::Duration::from_secs(1));
        }));
    }
}

unsafe fn client_ref<'a>(client: *const BinxClient) -> Result<&'a BinxClient, BinxStatus> {
    // SAFETY: a non-null pointer came from binx_connect (binx.h).
    unsafe { client.as_ref() }.ok_or_else(|| fail(BinxStatus::InvalidArgument, "client is NULL"))
}

/// The client and task id arguments most calls take.
unsafe fn client_and_task<'a>(
    client: *const BinxClient,
    task_id: *const c_char,
) -> Result<(&'a BinxClient, &'a str), BinxStatus> {
    // SAFETY: as for client_ref and text.
    unsafe { Ok((client_ref(client)?, text(task_id, "task_id")?)) }
}

/// Opens a task with `buffer_count` buffers (0: open-ended) of `kind`
/// (0 partitioned, 1 broadcast, 2 arbitrary).
///
/// # Safety
/// Pointers as in binx.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn binx_open_task(
    client: *const BinxClient,
    task_id: *const c_char,
    kind: c_int,
    buffer_count: u64,
) -> BinxStatus {
    guard(|| {
        // SAFETY: client is NULL or from binx_client_open, task_id NULL or a C string (binx.h); both checked for NULL.
        let (client, task) = match unsafe { client_and_task(client, task_id) } {
            Ok(both) => both,
            Err(s) => return s,
        };
        let kind = match kind {
            0 => BufferKind::Partitioned,
            1 => BufferKind::Broadcast,
            2 => BufferKind::Arbitrary,
            other => {
                return fail(
                    BinxStatus::InvalidArgument,
                    format!("buffer kind {other} is not 0, 1 or 2"),
                );
            }
        };
        let spec = TaskSpec {
            kind,
            buffer_count,
            spool_policy: String::new(),
        };
        match client
            .runtime
            .block_on(client.producer.open_task(task, &spec))
        {
            Ok(()) => BinxStatus::Ok,
            Err(e) => client_error(e),
        }
    })
}

/// Enqueues `count` pages (`pages[i]` of `sizes[i]` bytes) for a buffer. The
/// bytes are copied before the call returns; BUSY is retried up to the
/// producer's wait, then returned. See `binx_enqueue_counted`.
///
/// # Safety
/// `pages` and `sizes` point to `count` entries; each page to `sizes[i]` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn binx_enqueue(
    client: *const BinxClient,
    task_id: *const c_char,
    buffer_id: u64,
    pages: *const *const u8,
    sizes: *const usize,
    count: usize,
) -> BinxStatus {
    let mut stored = 0usize;
    // SAFETY: the caller's pointers as binx_enqueue_counted takes them; `stored` is ours.
    unsafe { binx_enqueue_counted(client, task_id, buffer_id, pages, sizes, count, &mut stored) }
}

/// [`binx_enqueue`], setting `*stored` (when not NULL) to the pages stored
/// for sure, from the first on: `count` on OK; on `BINX_ERR_PARTIAL` (a
/// later request of a call of several was refused) exactly the pages
/// stored; on `BINX_ERR_UNAVAILABLE` the pages stored for sure, those of
/// the request in flight after them unknown; 0 on any other error.
///
/// # Safety
/// As `binx_enqueue`; `stored` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn binx_enqueue_counted(
    client: *const BinxClient,
    task_id: *const c_char,
    buffer_id: u64,
    pages: *const *const u8,
    sizes: *const usize,
    count: usize,
    stored: *mut usize,
) -> BinxStatus {
    guard(|| {
        let report = |n: usize| {
            // SAFETY: stored is NULL or writable (binx.h).
            if let Some(out) = unsafe { stored.as_mut() } {
                *out = n;
            }
        };
        report(0);
        // SAFETY: client is NULL or from binx_client_open, task_id NULL or a C string (binx.h); both checked for NULL.
        let (client, task) = match unsafe { client_and_task(client, task_id) } {
            Ok(both) => both,
            Err(s) => return s,
        };
        if count > 0 && (pages.is_null() || sizes.is_null()) {
            return fail(BinxStatus::InvalidArgument, "pages or sizes is NULL");
        }
        // Every page checked before a byte of any is copied: no frame
        // carries one past the frame limit (and a size past isize::MAX is
        // no slice at all).
        for i in 0..count {
            // SAFETY: both arrays hold `count` entries (binx.h).
            let (page, size) = unsafe { (*pages.add(i), *sizes.add(i)) };
            if page.is_null() && size > 0 {
                return fail(BinxStatus::InvalidArgument, format!("page {i} is NULL"));
            }
            if size > binx_proto::codec::DEFAULT_MAX_FRAME_LENGTH {
                return fail(
                    BinxStatus::InvalidArgument,
                    format!(
                        "page {i} of buffer {buffer_id} of task {task} has {size} bytes; a page is at most 64 MiB (the frame limit, {} bytes, less its header)",
                        binx_proto::codec::DEFAULT_MAX_FRAME_LENGTH
                    ),
                );
            }
        }
        let mut batch = Vec::with_capacity(count);
        for i in 0..count {
            // SAFETY: both arrays hold `count` entries (binx.h).
            let (page, size) = unsafe { (*pages.add(i), *sizes.add(i)) };
            let bytes = if size == 0 {
                Bytes::new()
            } else {
                // SAFETY: page i points to `size` readable bytes, checked
                // above to be no NULL and within isize::MAX.
                Bytes::copy_from_slice(unsafe { std::slice::from_raw_parts(page, size) })
            };
            batch.push(bytes);
        }
        match client
            .runtime
            .block_on(client.producer.enqueue(task, buffer_id, &batch))
        {
            Ok(()) => {
                report(count);
                BinxStatus::Ok
            }
            Err(e) => {
                if let ClientError::PartlyStored { stored, .. } = &e {
                    report(*stored);
                }
                client_error(e)
            }
        }
    })
}

/// No more pages for a buffer, or for the whole task with `BINX_ALL_BUFFERS`.
///
/// # Safety
/// Pointers as in binx.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn binx_no_more_pages(
    client: *const BinxClient,
    task_id: *const c_char,
    buffer_id: u64,
) -> BinxStatus {
    guard(|| {
        // SAFETY: client is NULL or from binx_client_open, task_id NULL or a C string (binx.h); both checked for NULL.
        let (client, task) = match unsafe { client_and_task(client, task_id) } {
            Ok(both) => both,
            Err(s) => return s,
        };
        let buffer = (buffer_id != binx_proto::ALL_BUFFERS).then_some(buffer_id);
        match client
            .runtime
            .block_on(client.producer.no_more_pages(task, buffer))
        {
            Ok(()) => BinxStatus::Ok,
            Err(e) => client_error(e),
        }
    })
}

/// Aborts a task; its consumers see `reason` (may be NULL).
///
/// # Safety
/// Pointers as in binx.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn binx_abort_task(
    client: *const BinxClient,
    task_id: *const c_char,
    reason: *const c_char,
) -> BinxStatus {
    guard(|| {
        // SAFETY: client is NULL or from binx_client_open, task_id NULL or a C string (binx.h); both checked for NULL.
        let (client, task) = match unsafe { client_and_task(client, task_id) } {
            Ok(both) => both,
            Err(s) => return s,
        };
        let reason = if reason.is_null() {
            ""
        } else {
            // SAFETY: reason is not NULL here and is a C string (binx.h).
            match unsafe { text(reason, "reason") } {
                Ok(r) => r,
                Err(s) => return s,
            }
        };
        match client.runtime.block_on(client.producer.abort(task, reason)) {
            Ok(()) => BinxStatus::Ok,
            Err(e) => client_error(e),
        }
    })
}

/// Opens a source for buffer `buffer_id` of `task_id`: on the sidecar at
/// `remote` ("host:port", forwarded by the local sidecar), or on the local
/// sidecar itself when `remote` is NULL.
///
/// # Safety
/// Pointers as in binx.h; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn binx_source_open(
    client: *const BinxClient,
    remote: *const c_char,
    task_id: *const c_char,
    buffer_id: u64,
    out: *mut *mut BinxSource,
) -> BinxStatus {
    guard(|| {
        if out.is_null() {
            return fail(BinxStatus::InvalidArgument, "out is NULL");
        }
        let client_ptr = client;
        // SAFETY: client is NULL or from binx_client_open, task_id NULL or a C string (binx.h); both checked for NULL.
        let (client, task) = match unsafe { client_and_task(client, task_id) } {
            Ok(both) => both,
            Err(s) => return s,
        };
        let remote = if remote.is_null() {
            None
        } else {
            // SAFETY: remote is not NULL here and is a C string (binx.h).
            match unsafe { text(remote, "remote") } {
                Ok(r) => match binx_core::request::parse_remote(r) {
                    Ok(_) => Some(r.to_string()),
                    Err(why) => {
                        return fail(BinxStatus::InvalidArgument, format!("remote: {why}"));
                    }
                },
                Err(s) => return s,
            }
        };
        let config = SourceConfig {
            remote,
            ..SourceConfig::default()
        };
        let label = format!("buffer {buffer_id} of task {task}");
        let source = {
            let _enter = client.runtime.enter();
            ExchangeSource::new(
                client.producer.connection().clone(),
                task,
                buffer_id,
                config,
            )
        };
        let source = BinxSource {
            client: client_ptr,
            source,
            pending: None,
            viewed: None,
            done: false,
            failed: None,
            next_wait: None,
            label,
        };
        // SAFETY: checked non-null above.
        unsafe { *out = Box::into_raw(Box::new(source)) };
        BinxStatus::Ok
    })
}

/// The next page, held in `source.pending`; `Ok(false)` at the end.
fn next_page(source: &mut BinxSource) -> Result<bool, BinxStatus> {
    // The view of the previous call ends here.
    source.viewed = None;
    if source.pending.is_some() {
        return Ok(true);
    }
    if source.done {
        return Ok(false);
    }
    if let Some((status, message)) = &source.failed {
        return Err(fail(
            *status,
            format!("this source already failed: {message}"),
        ));
    }
    // SAFETY: the client outlives its sources (binx.h).
    let client = unsafe { client_ref(source.client) }?;
    let waited = match source.next_wait {
        // The pages wait in the source's inbox: a call that gives up takes none.
        Some(wait) => client
            .runtime
            .block_on(async { tokio::time::timeout(wait, source.source.next_page()).await }),
        None => Ok(client.runtime.block_on(source.source.next_page())),
    };
    let Ok(next) = waited else {
        let wait = source.next_wait.unwrap_or_default();
        return Err(fail(
            BinxStatus::NoPageYet,
            format!(
                "no page of {} within {} ms (binx_source_set_next_wait); nothing was consumed, the source goes on",
                source.label,
                wait.as_millis()
            ),
        ));
    };
    match next {
        Ok(Some(page)) => {
            source.pending = Some(page.data);
            Ok(true)
        }
        Ok(None) => {
            source.done = true;
            Ok(false)
        }
        Err(e) => {
            let message = e.to_string();
            let status = client_error(e);
            source.failed = Some((status, message));
            Err(status)
        }
    }
}

/// Copies the next page into `dst` (`capacity` bytes): sets `*page_len` and
/// `*end` (1 once the buffer is complete, then no page is returned). When
/// the page does not fit, returns `BINX_ERR_BUFFER_TOO_SMALL` with
/// `*page_len` set and keeps the page for the next call.
///
/// # Safety
/// `dst` has `capacity` writable bytes; `page_len` and `end` are writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn binx_source_next(
    source: *mut BinxSource,
    dst: *mut u8,
    capacity: usize,
    page_len: *mut usize,
    end: *mut c_int,
) -> BinxStatus {
    source_guard(source, || {
        // SAFETY: a non-null pointer came from binx_source_open.
        let Some(source) = (unsafe { source.as_mut() }) else {
            return fail(BinxStatus::InvalidArgument, "source is NULL");
        };
        // Checked before a page is taken, so nothing is consumed.
        if dst.is_null() || page_len.is_null() || end.is_null() {
            return fail(BinxStatus::InvalidArgument, "dst, page_len or end is NULL");
        }
        match next_page(source) {
            Err(s) => s,
            Ok(false) => {
                // SAFETY: page_len and end were checked not NULL above.
                unsafe { (*page_len, *end) = (0, 1) };
                BinxStatus::Ok
            }
            Ok(true) => {
                let len = source.pending.as_ref().map_or(0, Bytes::len);
                // SAFETY: page_len and end were checked not NULL above.
                unsafe { (*page_len, *end) = (len, 0) };
                if len > capacity {
                    return fail(
                        BinxStatus::BufferTooSmall,
                        format!("the next page has {len} bytes; the buffer holds {capacity}"),
                    );
                }
                if let Some(page) = source.pending.take()
                    && len > 0
                {
                    // SAFETY: dst has room for `len` bytes (checked above).
                    unsafe { std::ptr::copy_nonoverlapping(page.as_ptr(), dst, len) };
                }
                BinxStatus::Ok
            }
        }
    })
}

/// The next page as a borrowed view: `*data` and `*len` stay valid until the
/// next call on this source. `*end` is 1 once the buffer is complete.
///
/// # Safety
/// `data`, `len` and `end` are writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn binx_source_next_view(
    source: *mut BinxSource,
    data: *mut *const u8,
    len: *mut usize,
    end: *mut c_int,
) -> BinxStatus {
    source_guard(source, || {
        // SAFETY: a non-null pointer came from binx_source_open.
        let Some(source) = (unsafe { source.as_mut() }) else {
            return fail(BinxStatus::InvalidArgument, "source is NULL");
        };
        if data.is_null() || len.is_null() || end.is_null() {
            return fail(BinxStatus::InvalidArgument, "data, len or end is NULL");
        }
        match next_page(source) {
            Err(s) => s,
            Ok(false) => {
                // SAFETY: data, len and end were checked not NULL above.
                unsafe { (*data, *len, *end) = (std::ptr::null(), 0, 1) };
                BinxStatus::Ok
            }
            Ok(true) => {
                source.viewed = source.pending.take();
                let page = source.viewed.as_deref().unwrap_or(&[]);
                // SAFETY: data, len and end were checked not NULL above; the view lives in source.viewed until the next call.
                unsafe { (*data, *len, *end) = (page.as_ptr(), page.len(), 0) };
                BinxStatus::Ok
            }
        }
    })
}

/// How long `binx_source_next` and `binx_source_next_view` wait for the
/// next page: at most `millis` (0: as long as the buffer may still get
/// pages, the default). A call that gets none returns
/// `BINX_ERR_NO_PAGE_YET` with nothing consumed, and the source goes on.
///
/// # Safety
/// `source` came from `binx_source_open` (or is NULL).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn binx_source_set_next_wait(
    source: *mut BinxSource,
    millis: u32,
) -> BinxStatus {
    guard(|| {
        // SAFETY: a non-null pointer came from binx_source_open.
        let Some(source) = (unsafe { source.as_mut() }) else {
            return fail(BinxStatus::InvalidArgument, "source is NULL");
        };
        source.next_wait =
            (millis > 0).then(|| std::time::Duration::from_millis(u64::from(millis)));
        BinxStatus::Ok
    })
}

/// Closes a source (the buffer is deleted on the sidecar once read to its end).
///
/// # Safety
/// `source` came from `binx_source_open` and is not used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn binx_source_close(source: *mut BinxSource) {
    if !source.is_null() {
        // SAFETY: the caller gives up the pointer.
        let source = unsafe { Box::from_raw(source) };
        let client = source.client;
        let _sigpipe = sigpipe::Held::new();
        let _ = catch_unwind(AssertUnwindSafe(move || {
            // Dropping the source stops its fetcher (one read to its end
            // lets its DELETE go on, as long as the runtime runs), inside
            // the runtime.
            // SAFETY: a non-null client came from binx_client_open and is not yet closed (binx.h).
            match unsafe { client.as_ref() } {
                Some(c) => {
                    let _enter = c.runtime.enter();
                    drop(source);
                }
                None => drop(source),
            }
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::BinxStatus;

    /// include/binx.h's status numbers are the library's: a C engine
    /// compiled against the header reads what the library returns.
    #[test]
    fn the_header_names_every_status_the_library_returns() {
        let header = include_str!("../../../include/binx.h");
        let said: Vec<(String, i64)> = header
            .lines()
            .filter_map(|line| {
                let (name, rest) = line.trim().split_once(" = ")?;
                if !name.starts_with("BINX_OK") && !name.starts_with("BINX_ERR_") {
                    return None;
                }
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                Some((name.to_string(), digits.parse().ok()?))
            })
            .collect();
        let ours = [
            ("BINX_OK", BinxStatus::Ok),
            ("BINX_ERR_INVALID_ARGUMENT", BinxStatus::InvalidArgument),
            ("BINX_ERR_UNAVAILABLE", BinxStatus::Unavailable),
            ("BINX_ERR_BAD_REQUEST", BinxStatus::BadRequest),
            ("BINX_ERR_SERVER", BinxStatus::ServerError),
            ("BINX_ERR_BUSY", BinxStatus::Busy),
            ("BINX_ERR_TIMEOUT", BinxStatus::Timeout),
            ("BINX_ERR_UNAUTHENTICATED", BinxStatus::Unauthenticated),
            ("BINX_ERR_BUFFER_TOO_SMALL", BinxStatus::BufferTooSmall),
            ("BINX_ERR_UNSUPPORTED", BinxStatus::Unsupported),
            ("BINX_ERR_INTERNAL", BinxStatus::Internal),
            ("BINX_ERR_PARTIAL", BinxStatus::Partial),
            ("BINX_ERR_NO_PAGE_YET", BinxStatus::NoPageYet),
        ];
        let ours: Vec<(String, i64)> = ours
            .iter()
            .map(|(name, status)| (name.to_string(), *status as i64))
            .collect();
        assert_eq!(said, ours);
    }
}
