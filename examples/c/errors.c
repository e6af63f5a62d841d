/*
 * The C ABI's error paths, as an engine that is not ours meets them:
 *
 *   errors <uds_path> <task_prefix>
 *
 * Against a sidecar with a memory limit of 24 MiB (the test starts it):
 *  1. a call of 32 pages of 1 MiB: the first 16 are stored in one request,
 *     the next request stays BUSY: BINX_ERR_PARTIAL with *stored == 16, and
 *     the buffer holds exactly those 16;
 *  2. a page over the frame limit (80 MiB, and SIZE_MAX bytes, refused
 *     before a byte of it is read), and a task id over the header limit:
 *     BINX_ERR_INVALID_ARGUMENT at once, and the client still works;
 *  3. a source whose task was aborted: the error, then the same status at
 *     once on every later call (never a hang: alarm() ends a hang);
 *  4. a source with a bounded wait (binx_source_set_next_wait) of a task
 *     not opened yet: BINX_ERR_NO_PAGE_YET, nothing consumed, and the page
 *     written later still comes, then the end.
 * Prints "ok" and exits 0 when every check held.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "binx.h"

static int check(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "errors: %s (last error: %s)\n", what, binx_last_error());
        exit(1);
    }
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: errors <uds_path> <task_prefix>\n");
        return 2;
    }
    alarm(60);
    const char *uds = argv[1];
    char task[128], other[128], aborted[128];
    snprintf(task, sizeof task, "%s.partial", argv[2]);
    snprintf(other, sizeof other, "%s.other", argv[2]);
    snprintf(aborted, sizeof aborted, "%s.aborted", argv[2]);
    binx_client *client = NULL;
    binx_options options = {.use_shared_memory = 0, .max_error_millis = 500};
    check(binx_connect(uds, &options, &client) == BINX_OK, "connect");

    /* 1. Partly stored. */
    check(binx_open_task(client, task, BINX_PARTITIONED, 1) == BINX_OK, "open");
    enum { PAGES = 32, PAGE = 1 << 20 };
    const uint8_t *pages[PAGES];
    size_t sizes[PAGES];
    for (int i = 0; i < PAGES; i++) {
        uint8_t *p = malloc(PAGE);
        memset(p, i, PAGE);
        pages[i] = p;
        sizes[i] = PAGE;
    }
    size_t stored = 12345;
    binx_status s = binx_enqueue_counted(client, task, 0, pages, sizes, PAGES, &stored);
    check(s == BINX_ERR_PARTIAL, "32 MiB into 24 MiB is BINX_ERR_PARTIAL");
    check(stored == 16, "16 pages stored");
    check(strstr(binx_last_error(), "first 16 of 32 pages were stored") != NULL,
          "the message says how many");
    /* binx_enqueue says the same without the count. */
    s = binx_enqueue(client, task, 0, pages + 16, sizes + 16, 16);
    check(s == BINX_ERR_BUSY, "one request of 16 MiB more is BUSY: nothing stored");
    check(binx_no_more_pages(client, task, 0) == BINX_OK, "finish");
    binx_source *source = NULL;
    check(binx_source_open(client, NULL, task, 0, &source) == BINX_OK, "source");
    uint8_t *page = malloc(PAGE);
    int read = 0;
    for (;;) {
        size_t len = 0;
        int end = 0;
        check(binx_source_next(source, page, PAGE, &len, &end) == BINX_OK, "next");
        if (end) break;
        check(len == PAGE && page[0] == read && page[PAGE - 1] == read, "page intact");
        read++;
    }
    check(read == 16, "exactly the 16 stored pages are read back");
    binx_source_close(source);

    /* 2. Refused before anything is sent; the client goes on. */
    check(binx_open_task(client, other, BINX_PARTITIONED, 1) == BINX_OK, "open other");
    size_t huge_len = (size_t)80 << 20;
    uint8_t *huge = calloc(1, huge_len);
    const uint8_t *one[1] = {huge};
    stored = 7;
    s = binx_enqueue_counted(client, other, 0, one, &huge_len, 1, &stored);
    check(s == BINX_ERR_INVALID_ARGUMENT, "an 80 MiB page is INVALID_ARGUMENT");
    check(stored == 0, "nothing stored");
    /* Behind pages that fit one request: still refused before anything is sent. */
    const uint8_t *mixed[6] = {pages[0], pages[1], pages[2], pages[3], pages[4], huge};
    size_t mixed_sizes[6] = {PAGE, PAGE, PAGE, PAGE, PAGE, huge_len};
    stored = 7;
    s = binx_enqueue_counted(client, other, 0, mixed, mixed_sizes, 6, &stored);
    check(s == BINX_ERR_INVALID_ARGUMENT, "5 pages and an 80 MiB one is INVALID_ARGUMENT");
    check(stored == 0, "none of them stored");
    /* A size past the frame limit is refused before a byte of the page is
       read (binx.h): even one no memory could hold. */
    size_t no_such_size = SIZE_MAX;
    const uint8_t *tiny[1] = {pages[0]};
    stored = 7;
    s = binx_enqueue_counted(client, other, 0, tiny, &no_such_size, 1, &stored);
    check(s == BINX_ERR_INVALID_ARGUMENT, "a page of SIZE_MAX bytes is INVALID_ARGUMENT");
    check(strstr(binx_last_error(), "at most 64 MiB") != NULL, "the message says the limit");
    check(stored == 0, "nothing stored");
    size_t id_len = 100 * 1024;
    char *long_id = malloc(id_len + 1);
    memset(long_id, 'x', id_len);
    long_id[id_len] = 0;
    s = binx_open_task(client, long_id, BINX_PARTITIONED, 1);
    check(s == BINX_ERR_INVALID_ARGUMENT, "a 100 KiB task id is INVALID_ARGUMENT");
    const uint8_t small[3] = {1, 2, 3};
    const uint8_t *small_pages[1] = {small};
    size_t small_size = 3;
    check(binx_enqueue(client, other, 0, small_pages, &small_size, 1) == BINX_OK,
          "the client still works");
    check(binx_no_more_pages(client, other, 0) == BINX_OK, "finish other");
    check(binx_source_open(client, NULL, other, 0, &source) == BINX_OK, "source other");
    int others = 0;
    for (;;) {
        size_t len = 0;
        int end = 0;
        check(binx_source_next(source, page, PAGE, &len, &end) == BINX_OK, "next other");
        if (end) break;
        check(len == 3 && page[0] == 1 && page[2] == 3, "the small page intact");
        others++;
    }
    check(others == 1, "only the small page was stored: nothing of the refused calls");
    binx_source_close(source);

    /* 3. Errors end a source. */
    check(binx_open_task(client, aborted, BINX_PARTITIONED, 1) == BINX_OK, "open aborted");
    check(binx_abort_task(client, aborted, "on purpose") == BINX_OK, "abort");
    check(binx_source_open(client, NULL, aborted, 0, &source) == BINX_OK, "source aborted");
    size_t len = 0;
    int end = 0;
    binx_status first = binx_source_next(source, page, PAGE, &len, &end);
    check(first != BINX_OK, "an aborted task's source fails");
    for (int i = 0; i < 3; i++) {
        check(binx_source_next(source, page, PAGE, &len, &end) == first, "the same status again");
        check(strstr(binx_last_error(), "this source already failed") != NULL,
              "the message says the source failed");
        const uint8_t *data = NULL;
        check(binx_source_next_view(source, &data, &len, &end) == first, "the view too");
    }
    binx_source_close(source);

    /* Arguments no call could ever use are refused when given, not retried. */
    binx_client *never = NULL;
    check(binx_connect("", &options, &never) == BINX_ERR_INVALID_ARGUMENT && never == NULL,
          "an empty socket path");
    char long_path[200];
    memset(long_path, 'p', sizeof long_path - 1);
    long_path[0] = '/';
    long_path[sizeof long_path - 1] = 0;
    check(binx_connect(long_path, &options, &never) == BINX_ERR_INVALID_ARGUMENT && never == NULL,
          "a socket path longer than a Unix socket's");
    binx_source *bad_remote = NULL;
    check(binx_source_open(client, "garbage", other, 0, &bad_remote) == BINX_ERR_INVALID_ARGUMENT
              && bad_remote == NULL,
          "a remote that is not host:port");
    check(strstr(binx_last_error(), "remote") != NULL, "the message names the remote");

    /* 4. A bounded wait: NO_PAGE_YET with nothing consumed, and the source goes on. */
    char later[128];
    snprintf(later, sizeof later, "%s.later", argv[2]);
    check(binx_source_set_next_wait(NULL, 10) == BINX_ERR_INVALID_ARGUMENT, "a NULL source");
    check(binx_source_open(client, NULL, later, 0, &source) == BINX_OK, "source later");
    check(binx_source_set_next_wait(source, 200) == BINX_OK, "set the wait");
    for (int i = 0; i < 2; i++) {
        len = 7;
        end = 7;
        check(binx_source_next(source, page, PAGE, &len, &end) == BINX_ERR_NO_PAGE_YET,
              "no task yet: NO_PAGE_YET");
        check(strstr(binx_last_error(), "no page") != NULL, "the message says no page came");
        check(len == 7 && end == 7, "nothing written");
    }
    check(binx_open_task(client, later, BINX_PARTITIONED, 1) == BINX_OK, "open later");
    check(binx_enqueue(client, later, 0, small_pages, &small_size, 1) == BINX_OK, "a page later");
    check(binx_no_more_pages(client, later, 0) == BINX_OK, "finish later");
    check(binx_source_next(source, page, PAGE, &len, &end) == BINX_OK && !end && len == 3
              && page[0] == 1 && page[2] == 3,
          "the page that came later, intact");
    check(binx_source_next(source, page, PAGE, &len, &end) == BINX_OK && end, "then the end");
    binx_source_close(source);
    binx_close(client);
    printf("ok\n");
    return 0;
}
