/*
 * The C ABI against a sidecar that reads small frames, as an engine that
 * is not ours meets it:
 *
 *   frames <uds_path> <task_prefix>
 *
 * Against a sidecar with max_frame_size 64 KiB (the test starts it; its
 * HELLO says so):
 *  1. one call of three 30,000-byte pages is BINX_OK: the library sends them
 *     in frames within the sidecar's limit, and they read back intact;
 *  2. a 100,000-byte page, which no frame of the sidecar carries, is
 *     BINX_ERR_INVALID_ARGUMENT before anything of the call is sent, with
 *     *stored == 0 and a message naming max_frame_size; the client goes on.
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
        fprintf(stderr, "frames: %s (last error: %s)\n", what, binx_last_error());
        exit(1);
    }
    return 1;
}

/* Reads buffer 0 of task to its end; returns the pages read, each checked
 * to be `size` bytes of the byte (first + its index). */
static int read_back(binx_client *client, const char *task, size_t size, int first) {
    binx_source *source = NULL;
    check(binx_source_open(client, NULL, task, 0, &source) == BINX_OK, "source");
    uint8_t *page = malloc(1 << 20);
    int read = 0;
    for (;;) {
        size_t len = 0;
        int end = 0;
        check(binx_source_next(source, page, 1 << 20, &len, &end) == BINX_OK, "next");
        if (end) break;
        check(len == size && page[0] == (uint8_t)(first + read) &&
                  page[size - 1] == (uint8_t)(first + read),
              "page intact");
        read++;
    }
    free(page);
    binx_source_close(source);
    return read;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: frames <uds_path> <task_prefix>\n");
        return 2;
    }
    alarm(60);
    char task[128], large[128];
    snprintf(task, sizeof task, "%s.pages", argv[2]);
    snprintf(large, sizeof large, "%s.large", argv[2]);
    binx_client *client = NULL;
    binx_options options = {.use_shared_memory = 0, .max_error_millis = 500};
    check(binx_connect(argv[1], &options, &client) == BINX_OK, "connect");

    /* 1. Three pages that fit a frame each, in one call. */
    check(binx_open_task(client, task, BINX_PARTITIONED, 1) == BINX_OK, "open");
    enum { PAGE = 30000 };
    uint8_t *bytes[3];
    const uint8_t *pages[3];
    size_t sizes[3];
    for (int i = 0; i < 3; i++) {
        bytes[i] = malloc(PAGE);
        memset(bytes[i], 10 + i, PAGE);
        pages[i] = bytes[i];
        sizes[i] = PAGE;
    }
    size_t stored = 7;
    check(binx_enqueue_counted(client, task, 0, pages, sizes, 3, &stored) == BINX_OK,
          "three 30,000-byte pages into 64 KiB frames");
    check(stored == 3, "all three stored");
    check(binx_no_more_pages(client, task, 0) == BINX_OK, "finish");
    check(read_back(client, task, PAGE, 10) == 3, "the three pages read back");

    /* 2. A page no frame carries: refused before anything is sent. */
    check(binx_open_task(client, large, BINX_PARTITIONED, 1) == BINX_OK, "open large");
    size_t huge_len = 100000;
    uint8_t *huge = calloc(1, huge_len);
    const uint8_t *mixed[2] = {pages[0], huge};
    size_t mixed_sizes[2] = {PAGE, huge_len};
    stored = 7;
    binx_status s = binx_enqueue_counted(client, large, 0, mixed, mixed_sizes, 2, &stored);
    check(s == BINX_ERR_INVALID_ARGUMENT, "a 100,000-byte page is INVALID_ARGUMENT");
    check(stored == 0, "nothing of the call stored");
    check(strstr(binx_last_error(), "max_frame_size") != NULL, "the message names the setting");
    check(binx_enqueue(client, large, 0, pages + 1, sizes + 1, 1) == BINX_OK,
          "the client still works");
    check(binx_no_more_pages(client, large, 0) == BINX_OK, "finish large");
    check(read_back(client, large, PAGE, 11) == 1, "only the page that fits was stored");

    for (int i = 0; i < 3; i++) free(bytes[i]);
    free(huge);
    binx_close(client);
    printf("ok\n");
    return 0;
}
