/* The command tests run through `gpu-isolator exec` (tests/support/services.py).
   exec_probe [PATH | r:PATH]... [--hold | --serve] [--exit N]: opens each PATH (O_RDWR; r: O_RDONLY,
   reported as PATH), then prints one JSON line -- errno per path (0 = opened), its pid, parent pid,
   uids, gid, supplementary groups, NoNewPrivs and Uid lines of /proc/self/status, /proc/self/cgroup,
   its working directory and the visible-devices variables -- then, with --hold, waits until its stdin
   closes; with --serve, opens each path read from a line of stdin (O_RDWR) and prints its errno, until
   stdin closes; and exits with N. Plain C and libc, so any user can run it from a directory they can
   reach. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void json_string(const char *text) {
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)(text ? text : ""); *p; p++) {
        if (*p == '"' || *p == '\\') printf("\\%c", *p);
        else if (*p < 0x20) printf("\\u%04x", *p);
        else putchar(*p);
    }
    putchar('"');
}

static void file_text(const char *path, char *out, size_t size) {
    out[0] = 0;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return;
    ssize_t got = read(fd, out, size - 1);
    close(fd);
    out[got > 0 ? got : 0] = 0;
}

static void status_line(const char *status, const char *name, char *out, size_t size) {
    out[0] = 0;
    const char *at = strstr(status, name);
    if (!at) return;
    at += strlen(name);
    while (*at == ' ' || *at == '\t') at++;
    size_t n = strcspn(at, "\n");
    if (n >= size) n = size - 1;
    memcpy(out, at, n);
    out[n] = 0;
}

int main(int argc, char **argv) {
    int hold = 0, serve = 0, code = 0;
    printf("{\"open\": {");
    int first = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--hold")) { hold = 1; continue; }
        if (!strcmp(argv[i], "--serve")) { serve = 1; continue; }
        if (!strcmp(argv[i], "--exit") && i + 1 < argc) { code = atoi(argv[++i]); continue; }
        const char *path = argv[i];
        int flags = O_RDWR;
        if (!strncmp(path, "r:", 2)) { path += 2; flags = O_RDONLY; }
        int fd = open(path, flags);
        int err = fd < 0 ? errno : 0;
        if (fd >= 0) close(fd);
        if (!first) printf(", ");
        first = 0;
        json_string(path);
        printf(": %d", err);
    }
    char status[8192], cgroup[8192], nnp[64], uids[128], cwd[4096];
    file_text("/proc/self/status", status, sizeof status);
    file_text("/proc/self/cgroup", cgroup, sizeof cgroup);
    status_line(status, "NoNewPrivs:", nnp, sizeof nnp);
    status_line(status, "Uid:", uids, sizeof uids);
    if (!getcwd(cwd, sizeof cwd)) strcpy(cwd, "?");
    gid_t groups[256];
    int count = getgroups(256, groups);
    printf("}, \"pid\": %d, \"ppid\": %d, \"uid\": %d, \"euid\": %d, \"gid\": %d, \"groups\": [",
           getpid(), getppid(), getuid(), geteuid(), getgid());
    for (int i = 0; i < count; i++) printf("%s%d", i ? ", " : "", groups[i]);
    printf("], \"NoNewPrivs\": ");
    json_string(nnp);
    printf(", \"Uid\": ");
    json_string(uids);
    printf(", \"cgroup\": ");
    json_string(cgroup);
    printf(", \"cwd\": ");
    json_string(cwd);
    printf(", \"NVIDIA_VISIBLE_DEVICES\": ");
    if (getenv("NVIDIA_VISIBLE_DEVICES")) json_string(getenv("NVIDIA_VISIBLE_DEVICES")); else printf("null");
    printf(", \"CUDA_VISIBLE_DEVICES\": ");
    if (getenv("CUDA_VISIBLE_DEVICES")) json_string(getenv("CUDA_VISIBLE_DEVICES")); else printf("null");
    printf("}\n");
    fflush(stdout);
    if (hold) {
        char buffer[256];
        while (read(0, buffer, sizeof buffer) > 0) {}
    }
    if (serve) {
        char line[4096];
        while (fgets(line, sizeof line, stdin)) {
            line[strcspn(line, "\n")] = 0;
            int fd = open(line, O_RDWR);
            printf("%d\n", fd < 0 ? errno : 0);
            if (fd >= 0) close(fd);
            fflush(stdout);
        }
    }
    return code;
}
