/*
 * binx.h: the C ABI of binx (crate binx-capi, over binx-client), for
 * engines written in C or C++.
 *
 * Link with libbinx.a (plus -lpthread -ldl -lm) or libbinx.so,
 * both built by `cargo build --release -p binx-capi`.
 *
 * Every call but binx_close, binx_source_close and binx_last_error
 * returns a binx_status. On anything but BINX_OK,
 * binx_last_error() gives a sentence naming what failed (task, buffer,
 * sidecar); it is per thread and valid until that thread's next call.
 *
 * Thread safety: calls on one binx_client may be made from any number of
 * threads at once. A binx_source is used by one thread at a time. Close every
 * source of a client before the client.
 *
 * Ownership: binx_connect and binx_source_open give the caller a handle that
 * only binx_close and binx_source_close free, each exactly once; using a
 * handle after closing it, closing it twice, or closing a client before its
 * sources is undefined behaviour. Out-parameters (*out, *page_len, ...)
 * are written only when the call returns BINX_OK, unless a call says
 * otherwise (binx_source_next sets *page_len and *end = 0 on
 * BINX_ERR_BUFFER_TOO_SMALL; binx_enqueue_counted sets *stored always). binx never keeps a pointer the caller passed in after the call
 * returns (page bytes are copied).
 *
 * Limits: a task id is 1 to 256 bytes of A-Z, a-z, 0-9, '.', '_', '-'
 * and ':', and neither "." nor ".." (the sidecar refuses others with
 * BINX_ERR_BAD_REQUEST; bad UTF-8 is BINX_ERR_INVALID_ARGUMENT); one page is at most 64 MiB (this
 * library's frame limit, 64 MiB + 64 KiB, less room for the header): a
 * larger page, or a request whose header would pass 64 KiB, is refused with
 * BINX_ERR_INVALID_ARGUMENT before anything of the call is sent (a page of
 * more than 64 MiB + 64 KiB before a byte of it is read). A sidecar
 * whose max_frame_size is lower says so (its HELLO): pages are then sent in
 * frames within it, and a page no frame of it carries is refused with
 * BINX_ERR_INVALID_ARGUMENT before anything of the call is sent.
 *
 * Signals: a write to a sidecar that closed its socket (it restarted, or
 * cut the connection) never ends the process with SIGPIPE: binx's own
 * threads block SIGPIPE, and each call blocks it on the calling thread while
 * it runs, takes back a SIGPIPE that came pending meanwhile (its writes',
 * or one sent to that thread or, blocked everywhere, to the process while
 * the call ran), and restores the thread's mask; the call returns the
 * error. binx changes no signal's disposition.
 */
#ifndef BINX_H
#define BINX_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum binx_status {
    BINX_OK = 0,
    BINX_ERR_INVALID_ARGUMENT = 1, /* NULL pointer, bad UTF-8, value out of range */
    BINX_ERR_UNAVAILABLE = 2,      /* the sidecar cannot be reached (also: a spooled
                                      segment could not be fetched from storage) */
    BINX_ERR_BAD_REQUEST = 3,      /* the sidecar refused the request (BAD_REQUEST) */
    BINX_ERR_SERVER = 4,           /* the sidecar failed or the task was aborted */
    BINX_ERR_BUSY = 5,             /* no room; nothing was stored; retry later */
    BINX_ERR_TIMEOUT = 6,          /* no reply in time */
    BINX_ERR_UNAUTHENTICATED = 7,
    BINX_ERR_BUFFER_TOO_SMALL = 8, /* the next page does not fit; nothing consumed */
    BINX_ERR_UNSUPPORTED = 9,      /* reserved: not returned by this version */
    BINX_ERR_INTERNAL = 10,        /* a bug in binx; the message says where */
    BINX_ERR_PARTIAL = 11,         /* binx_enqueue: the first pages were stored, then a
                                      later request was refused; see binx_enqueue_counted */
    BINX_ERR_NO_PAGE_YET = 12      /* no page within binx_source_set_next_wait's wait;
                                      nothing consumed; the source goes on */
} binx_status;

/* Buffer kinds (binx_open_task): PARTITIONED, each buffer gets the pages
 * enqueued to it; BROADCAST, every buffer sees every page (an enqueue's
 * buffer_id is ignored); ARBITRARY, each page goes to one consumer,
 * whichever buffer asks first (an enqueue's buffer_id is ignored). A task of
 * buffer_count 0 is open-ended: buffers are made as they are named (up to the
 * sidecar's max_buffers_per_task). */
enum { BINX_PARTITIONED = 0, BINX_BROADCAST = 1, BINX_ARBITRARY = 2 };

/* buffer_id meaning "every buffer of the task" (binx_no_more_pages). */
#define BINX_ALL_BUFFERS UINT64_MAX

typedef struct BinxClient binx_client;
typedef struct BinxSource binx_source;

/* Message of the last failing call on this thread ("" if none). */
const char *binx_last_error(void);

/* Options of binx_connect; zero fields mean the default. */
typedef struct binx_options {
    int use_shared_memory;     /* 1: frames go through shared memory regions attached on the
                                  socket (docs/PROTOCOL.md section 6); a sidecar that refuses
                                  makes the first call fail with its reason */
    uint32_t max_error_millis; /* retry an unreachable or busy sidecar this long (0: 3 min) */
} binx_options;

/* Connects to the local sidecar's Unix socket (lazily: the first request
 * connects). A source may also fetch spooled segments the sidecar names
 * (signed HTTPS URLs of the object store) itself, checking each against
 * what the sidecar said of it; a fetch or check that fails is
 * BINX_ERR_UNAVAILABLE. options may be NULL (defaults). A path no Unix socket can have
 * (empty, or 108 bytes or more) is BINX_ERR_INVALID_ARGUMENT now. Thread-safe. */
binx_status binx_connect(const char *uds_path, const binx_options *options, binx_client **out);

/* Closes the client; NULL is ignored. Not concurrently with other calls on it. */
void binx_close(binx_client *client);

/* Producer calls. Thread-safe. */
binx_status binx_open_task(const binx_client *client, const char *task_id, int kind,
                           uint64_t buffer_count /* 0: open-ended */);
/* pages[i] has sizes[i] bytes; the bytes are copied before the call returns.
 * Pages are sent in order, in requests of at most 4096 pages and 16 MiB each,
 * and within what the sidecar says one takes (its max_pages_per_enqueue
 * pages, its max_frame_size, and about the smaller of its memory limits,
 * counting 128 bytes a page besides its bytes); a larger page goes alone.
 * BUSY, and a sidecar that cannot be reached (nothing was sent), are
 * retried for max_error_millis, then returned:
 * BINX_ERR_BUSY means nothing of this call was stored. When a request after
 * the first is refused (BUSY past max_error_millis, BAD_REQUEST, ...; the
 * message says which), the call returns BINX_ERR_PARTIAL: exactly its first
 * pages were stored, and sending them again would duplicate them; use
 * binx_enqueue_counted to learn how many. After BINX_ERR_UNAVAILABLE or
 * BINX_ERR_TIMEOUT (the connection broke, no reply came), the pages of the
 * request in flight may or may not have been stored, and so may the
 * requests before it: never send the whole call again blindly;
 * binx_enqueue_counted says how many pages were stored for sure. */
binx_status binx_enqueue(const binx_client *client, const char *task_id, uint64_t buffer_id,
                         const uint8_t *const *pages, const size_t *sizes, size_t count);
/* binx_enqueue, and *stored (if stored is not NULL) is set on every return to
 * the pages stored for sure, from pages[0] on: count on BINX_OK; on
 * BINX_ERR_PARTIAL exactly the pages stored (to go on, send pages[*stored]
 * onwards again); on BINX_ERR_UNAVAILABLE or BINX_ERR_TIMEOUT the pages
 * stored for sure, those of the request in flight after them unknown; 0 on
 * any other error. */
binx_status binx_enqueue_counted(const binx_client *client, const char *task_id,
                                 uint64_t buffer_id, const uint8_t *const *pages,
                                 const size_t *sizes, size_t count, size_t *stored);
binx_status binx_no_more_pages(const binx_client *client, const char *task_id,
                               uint64_t buffer_id /* or BINX_ALL_BUFFERS */);
/* Aborts the task: the sidecar frees it and its readers fail with reason
 * (cut to its first 4096 bytes). Aborting a task the sidecar does not hold
 * is BINX_OK (there is nothing to free). */
binx_status binx_abort_task(const binx_client *client, const char *task_id,
                            const char *reason /* may be NULL */);

/* Consumer calls. binx_source_open is thread-safe; the rest act on one
 * source, from one thread at a time.
 * remote: "host:port" of the sidecar that holds the buffer (the local sidecar
 * forwards; anything else is BINX_ERR_INVALID_ARGUMENT at binx_source_open),
 * or NULL for a buffer of the local sidecar. Pages come in token
 * order, each exactly once; the buffer is deleted once read to its end.
 * A local sidecar that restarted after pages of the buffer were read lost
 * the rest of it: the read fails with BINX_ERR_SERVER naming the restart,
 * never going on with pages a producer wrote to the new process under the
 * same task id (another run). A buffer of a task not opened yet is waited
 * for (a consumer may start before its producer). */
binx_status binx_source_open(const binx_client *client, const char *remote,
                             const char *task_id, uint64_t buffer_id, binx_source **out);
/* Copies the next page into dst (not NULL). *end = 1 (and *page_len = 0) once the
 * buffer is complete. If the page is larger than capacity: returns
 * BINX_ERR_BUFFER_TOO_SMALL with *page_len set; call again with more room. */
binx_status binx_source_next(binx_source *source, uint8_t *dst, size_t capacity,
                             size_t *page_len, int *end);
/* The next page as a view into binx's memory, valid until the next call on
 * this source (no copy). *end = 1 once the buffer is complete. */
binx_status binx_source_next_view(binx_source *source, const uint8_t **data, size_t *len,
                                  int *end);
/* Errors end a source: after an error reading the buffer (any status but
 * BINX_OK, BINX_ERR_BUFFER_TOO_SMALL, BINX_ERR_INVALID_ARGUMENT for a NULL
 * argument and BINX_ERR_NO_PAGE_YET; also BUSY or TIMEOUT, which binx
 * already retried for
 * max_error_millis), every later binx_source_next or binx_source_next_view
 * returns the same status at once, its message starting "this source
 * already failed": the source reads no more. */
/* How long binx_source_next and binx_source_next_view wait for the next
 * page: at most millis (0, the default: as long as the buffer may still get
 * pages, e.g. a task not opened yet). A call that gets no page in time
 * returns BINX_ERR_NO_PAGE_YET with nothing consumed; unlike errors it does
 * not end the source, and the next call waits again. From the thread that
 * uses the source. */
binx_status binx_source_set_next_wait(binx_source *source, uint32_t millis);
/* Closes the source; NULL is ignored. */
void binx_source_close(binx_source *source);

#ifdef __cplusplus
}
#endif

#endif /* BINX_H */
