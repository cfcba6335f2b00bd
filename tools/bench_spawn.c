/*
 * Starting one bench child: this executable again (/proc/self/exe) with the
 * hidden --child flag, the input arena's descriptor (inherited: memfds are
 * not close-on-exec here) and a pipe for the result struct.
 */
#define _GNU_SOURCE
#include "bench.h"

#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* Runs one impl in a child; fills res (res->ok = 0 with a reason on failure). */
void ft_bench_spawn(const ft_config *cfg, const ft_problem *p, int impl, ft_bench_result *res)
{
    memset(res, 0, sizeof *res);
    res->impl = impl;
    int fds[2];
    if (pipe(fds) != 0) {
        snprintf(res->error, sizeof res->error, "pipe: %s", strerror(errno));
        return;
    }
    fcntl(fds[0], F_SETFD, FD_CLOEXEC);

    /* argv: the config travels as one --set per key, printed by the same
     * table that parses it, so the child sees exactly this config. */
    size_t nkeys = ft_config_key_count();
    size_t argc = 0;
    char **argv = calloc(10 + 2 * nkeys, sizeof *argv);
    char (*sets)[192] = calloc(nkeys, sizeof *sets);
    char pfd[32], rfd[32];
    snprintf(pfd, sizeof pfd, "%d", p->fd);
    snprintf(rfd, sizeof rfd, "%d", fds[1]);
    if (argv == NULL || sets == NULL) {
        snprintf(res->error, sizeof res->error, "out of memory");
        goto out;
    }
    argv[argc++] = "fusedgrpo";
    argv[argc++] = "bench";
    argv[argc++] = "--child";
    argv[argc++] = (char *)ft_impl_name(impl);
    argv[argc++] = "--problem-fd";
    argv[argc++] = pfd;
    argv[argc++] = "--result-fd";
    argv[argc++] = rfd;
    for (size_t i = 0; i < nkeys; i++) {
        char val[128];
        ft_config_format(cfg, ft_config_key_name(i), val, sizeof val);
        snprintf(sets[i], sizeof sets[i], "%s=%s", ft_config_key_name(i), val);
        argv[argc++] = "--set";
        argv[argc++] = sets[i];
    }
    argv[argc] = NULL;

    pid_t pid;
    int rc = posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, environ);
    close(fds[1]);
    fds[1] = -1;
    if (rc != 0) {
        snprintf(res->error, sizeof res->error, "cannot start a child: %s", strerror(rc));
        goto out;
    }
    size_t got = 0;
    while (got < sizeof *res) {
        ssize_t n = read(fds[0], (char *)res + got, sizeof *res - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    int wst = 0;
    while (waitpid(pid, &wst, 0) < 0 && errno == EINTR)
        ;
    if (got != sizeof *res) {
        memset(res, 0, sizeof *res);
        res->impl = impl;
        if (WIFSIGNALED(wst))
            snprintf(res->error, sizeof res->error, "child killed by signal %d%s", WTERMSIG(wst),
                     WTERMSIG(wst) == 9 ? " (out of memory?)" : "");
        else
            snprintf(res->error, sizeof res->error, "child exited with status %d without a result",
                     WEXITSTATUS(wst));
    }
out:
    if (fds[1] >= 0)
        close(fds[1]);
    close(fds[0]);
    free(argv);
    free(sets);
}

