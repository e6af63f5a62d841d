/*
 * An engine that leaves SIGPIPE as the process starts (its default action
 * ends the process) while its sidecar's connection breaks in the middle of
 * a request the library is writing:
 *
 *   sigpipe <uds_path> <task>
 *
 * The test puts a relay in front of the sidecar that cuts every connection
 * after 1 MiB from the client, without reading the rest: the library's
 * write of a 4 MiB request meets a closed socket (EPIPE). The call must
 * return an error (the connection was lost), never end the process.
 * Prints "ok <status> <stored>" and exits 0 when it did.
 */
#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "binx.h"

#define PAGES 64
#define PAGE_BYTES (64 * 1024)

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: sigpipe <uds_path> <task>\n");
        return 2;
    }
    alarm(60);
    struct sigaction current;
    if (sigaction(SIGPIPE, NULL, &current) != 0 || current.sa_handler != SIG_DFL) {
        fprintf(stderr, "sigpipe: SIGPIPE must start with its default action\n");
        return 1;
    }
    binx_options options = {0};
    options.max_error_millis = 2000;
    binx_client *client = NULL;
    if (binx_connect(argv[1], &options, &client) != BINX_OK) {
        fprintf(stderr, "sigpipe: connect: %s\n", binx_last_error());
        return 1;
    }
    if (binx_open_task(client, argv[2], 0, 1) != BINX_OK) {
        fprintf(stderr, "sigpipe: open: %s\n", binx_last_error());
        return 1;
    }
    static uint8_t bytes[PAGE_BYTES];
    memset(bytes, 7, sizeof bytes);
    const uint8_t *pages[PAGES];
    size_t sizes[PAGES];
    for (int i = 0; i < PAGES; i++) {
        pages[i] = bytes;
        sizes[i] = sizeof bytes;
    }
    size_t stored = PAGES + 1;
    binx_status status = binx_enqueue_counted(client, argv[2], 0, pages, sizes, PAGES, &stored);
    if (status == BINX_OK || stored > 0) {
        fprintf(stderr, "sigpipe: a cut request was stored: status %d, %zu pages\n", (int)status, stored);
        return 1;
    }
    /* A second call meets the broken connection again. */
    status = binx_enqueue_counted(client, argv[2], 0, pages, sizes, PAGES, &stored);
    if (status == BINX_OK) {
        fprintf(stderr, "sigpipe: the second cut request was stored\n");
        return 1;
    }
    binx_close(client);
    /* SIGPIPE is as the engine left it: the library changed nothing. */
    sigset_t blocked;
    if (sigaction(SIGPIPE, NULL, &current) != 0 || current.sa_handler != SIG_DFL
        || pthread_sigmask(SIG_BLOCK, NULL, &blocked) != 0 || sigismember(&blocked, SIGPIPE)) {
        fprintf(stderr, "sigpipe: the library changed how SIGPIPE is handled\n");
        return 1;
    }
    printf("ok %d %zu\n", (int)status, stored);
    return 0;
}
