/*
 * A minimal engine in C: produces a buffer of pages through its sidecar,
 * then consumes it back (optionally through the sidecar at a remote
 * host:port), and checks every byte.
 *
 *   engine [--shm] <uds_path> <task_id> [remote host:port]
 *
 * With --shm every frame goes through shared memory instead of the socket.
 * Prints "ok <pages> <bytes>" and exits 0 when every page came back intact.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "binx.h"

#define PAGES 200

static int fail(const char *what, binx_status status) {
    fprintf(stderr, "engine: %s failed (%d): %s\n", what, (int)status, binx_last_error());
    return 1;
}

/* Page i: a length that varies with i (0 to ~300 KiB) and bytes derived from i. */
static size_t page_len(int i) { return (size_t)((i * 7919) % 300000) * (i % 5 != 0); }
static uint8_t page_byte(int i, size_t k) { return (uint8_t)(i * 31 + k * 7); }

int main(int argc, char **argv) {
    int use_shm = argc > 1 && strcmp(argv[1], "--shm") == 0;
    argv += use_shm;
    argc -= use_shm;
    if (argc < 3) {
        fprintf(stderr, "usage: engine [--shm] <uds_path> <task_id> [remote host:port]\n");
        return 2;
    }
    const char *uds = argv[1], *task = argv[2], *remote = argc > 3 ? argv[3] : NULL;
    binx_client *client = NULL;
    binx_status s;

    /* Give up after 2 s if the sidecar cannot be reached. */
    binx_options options = {.use_shared_memory = use_shm, .max_error_millis = 2000};
    if ((s = binx_connect(uds, &options, &client)) != BINX_OK) return fail("binx_connect", s);
    if ((s = binx_open_task(client, task, BINX_PARTITIONED, 1)) != BINX_OK)
        return fail("binx_open_task", s);

    /* Produce in batches of 10 pages. */
    size_t produced = 0;
    for (int base = 0; base < PAGES; base += 10) {
        const uint8_t *pages[10];
        size_t sizes[10];
        for (int j = 0; j < 10; j++) {
            int i = base + j;
            size_t n = page_len(i);
            uint8_t *p = malloc(n ? n : 1);
            for (size_t k = 0; k < n; k++) p[k] = page_byte(i, k);
            pages[j] = p;
            sizes[j] = n;
            produced += n;
        }
        s = binx_enqueue(client, task, 0, pages, sizes, 10);
        for (int j = 0; j < 10; j++) free((void *)pages[j]);
        if (s != BINX_OK) return fail("binx_enqueue", s);
    }
    if ((s = binx_no_more_pages(client, task, BINX_ALL_BUFFERS)) != BINX_OK)
        return fail("binx_no_more_pages", s);

    /* Consume: odd pages by copy into a small buffer that grows on demand,
     * even pages as borrowed views. */
    binx_source *source = NULL;
    if ((s = binx_source_open(client, remote, task, 0, &source)) != BINX_OK)
        return fail("binx_source_open", s);
    {
        /* A NULL buffer is refused before a page is taken (binx.h). */
        size_t len = 0;
        int end = 0;
        if ((s = binx_source_next(source, NULL, 0, &len, &end)) != BINX_ERR_INVALID_ARGUMENT) {
            fprintf(stderr, "engine: binx_source_next with a NULL buffer gave %d\n", (int)s);
            return 1;
        }
    }
    size_t cap = 1024, got = 0;
    uint8_t *buf = malloc(cap);
    int i = 0;
    for (;;) {
        const uint8_t *data;
        size_t len;
        int end = 0;
        if (i % 2 == 0) {
            s = binx_source_next_view(source, &data, &len, &end);
        } else {
            s = binx_source_next(source, buf, cap, &len, &end);
            if (s == BINX_ERR_BUFFER_TOO_SMALL) {
                cap = len;
                buf = realloc(buf, cap);
                s = binx_source_next(source, buf, cap, &len, &end);
            }
            data = buf;
        }
        if (s != BINX_OK) return fail("reading the source", s);
        if (end) break;
        if (i >= PAGES || len != page_len(i)) {
            fprintf(stderr, "engine: page %d has %zu bytes, expected %zu\n", i, len,
                    i < PAGES ? page_len(i) : 0);
            return 1;
        }
        for (size_t k = 0; k < len; k++) {
            if (data[k] != page_byte(i, k)) {
                fprintf(stderr, "engine: page %d differs at byte %zu\n", i, k);
                return 1;
            }
        }
        got += len;
        i++;
    }
    free(buf);
    binx_source_close(source);
    if (i != PAGES || got != produced) {
        fprintf(stderr, "engine: got %d pages (%zu bytes), produced %d (%zu)\n", i, got, PAGES,
                produced);
        return 1;
    }

    /* Errors name what was wrong. */
    const uint8_t byte = 1, *one[1] = {&byte};
    size_t one_size[1] = {1};
    s = binx_enqueue(client, "never-opened", 0, one, one_size, 1);
    if (s != BINX_ERR_BAD_REQUEST || !strstr(binx_last_error(), "never-opened")) {
        fprintf(stderr, "engine: ENQUEUE to an unknown task gave %d: %s\n", (int)s, binx_last_error());
        return 1;
    }
    binx_close(client);
    printf("ok %d %zu\n", i, got);
    return 0;
}
