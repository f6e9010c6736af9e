/*
 * A stand-in for nvidia-cuda-mps-control, the MPS control daemon and its
 * client, for tests without a GPU (R-MP-1, R-MP-2). Facts it copies come
 * from NVIDIA's MPS documentation (docs/guides/mps.md cites them).
 *
 * Rules:
 * - Built by the tests with gcc (actors/mps/testing.py). One binary, two
 *   roles, as the real tool has:
 *   - "fake_mps_control -d" starts the control daemon in the background:
 *     it binds "control" (a unix socket) in $CUDA_MPS_PIPE_DIRECTORY
 *     (default /tmp/nvidia-mps), opens control.log in
 *     $CUDA_MPS_LOG_DIRECTORY (default /var/log/nvidia-mps), forks, and the
 *     first process exits 0 once the daemon has written its PID to
 *     nvidia-cuda-mps-control.pid in the pipe directory. A directory it
 *     cannot use makes the first process exit 1 naming it on stderr (and in
 *     control.log where that opened). The daemon calls setsid and reads
 *     nothing from its stdin: it is nobody's child but init's (or a
 *     subreaper's), as the real -d daemon is.
 *   - "fake_mps_control" without -d is the client: it reaches the daemon
 *     through $CUDA_MPS_PIPE_DIRECTORY, sends each line of its stdin as one
 *     command and prints the daemon's answer on stdout. No daemon there:
 *     exit 1 with a message on stderr.
 * - Commands (the real tool's names and arguments): quit; get_server_list;
 *   start_server -uid <uid> (forks a stand-in server process that sleeps
 *   until quit, and dies with the daemon); set_default_active_thread_percentage <pct>;
 *   get_default_active_thread_percentage; set_default_device_pinned_mem_limit
 *   <dev> <value>; get_default_device_pinned_mem_limit <dev>;
 *   set_active_thread_percentage <server pid> <pct>;
 *   set_device_pinned_mem_limit <server pid> <dev> <value>. <dev> is 0 (the
 *   index of the one device a daemon of one unit sees) or the UUID in the
 *   daemon's $CUDA_VISIBLE_DEVICES, which is accepted but, as NVIDIA's device
 *   plugin found of the real daemon (NVIDIA/k8s-device-plugin#572: limits
 *   set by UUID are not applied), changes nothing:
 *   get_default_device_pinned_mem_limit still answers the limit set by
 *   index (0 when none was); <value> is a whole
 *   number with an optional K, M or G suffix; <pct> is in (0, 100]. A
 *   command it cannot accept is answered with a line starting "Error:"
 *   (the stand-in's own wording), anything else with its value or nothing.
 * - Every command received is written to control.log ("Cmd: <line>", as
 *   NVIDIA documents control.log to hold user commands) and, when
 *   $FAKE_MPS_RECORD names a file, appended there as
 *   "<CUDA_VISIBLE_DEVICES>\tcommand\t<line>"; a daemon's start is recorded
 *   as "<CUDA_VISIBLE_DEVICES>\tstart\t<pid>", then the /dev/shm it sees as
 *   "<CUDA_VISIBLE_DEVICES>\tshm\t<st_dev>:<st_ino>" (where its servers and
 *   clients would share memory). Tests judge by that file.
 * - Fault injection for tests: $FAKE_MPS_FAIL="<code>:<text>" makes -d write
 *   <text> to control.log and stderr and exit <code> without starting;
 *   $FAKE_MPS_IGNORE_QUIT=1 (read by -d) makes the daemon answer quit and
 *   go on running (a daemon that hangs on its way out).
 * - SIGTERM ends the daemon as quit does; SIGKILL leaves the control socket
 *   and the PID file behind, as a killed daemon does.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_SERVERS 8

static char pipe_dir[512] = "/tmp/nvidia-mps";
static char log_dir[512] = "/var/log/nvidia-mps";
static char socket_path[600];
static char pid_path[600];
static FILE *control_log;
static const char *visible = "";
static double default_percentage = 100.0;
static char default_limit[128] = "";
static pid_t servers[MAX_SERVERS];
static int server_count;
static volatile sig_atomic_t stopping;

static void log_line(const char *format, ...)
{
    struct timeval now;
    struct tm parts;
    char stamp[64];
    va_list args;
    if (control_log == NULL) {
        return;
    }
    gettimeofday(&now, NULL);
    localtime_r(&now.tv_sec, &parts);
    strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S", &parts);
    fprintf(control_log, "[%s.%03ld Control %ld] ", stamp, (long)(now.tv_usec / 1000), (long)getpid());
    va_start(args, format);
    vfprintf(control_log, format, args);
    va_end(args);
    fputc('\n', control_log);
    fflush(control_log);
}

static void record(const char *event, const char *detail)
{
    const char *path = getenv("FAKE_MPS_RECORD");
    FILE *file;
    if (path == NULL || *path == '\0') {
        return;
    }
    file = fopen(path, "a");
    if (file != NULL) {
        fprintf(file, "%s\t%s\t%s\n", visible, event, detail);
        fclose(file);
    }
}

static void read_environment(void)
{
    const char *value = getenv("CUDA_MPS_PIPE_DIRECTORY");
    if (value != NULL && *value != '\0') {
        snprintf(pipe_dir, sizeof pipe_dir, "%s", value);
    }
    value = getenv("CUDA_MPS_LOG_DIRECTORY");
    if (value != NULL && *value != '\0') {
        snprintf(log_dir, sizeof log_dir, "%s", value);
    }
    value = getenv("CUDA_VISIBLE_DEVICES");
    visible = value != NULL ? value : "";
    snprintf(socket_path, sizeof socket_path, "%s/control", pipe_dir);
    snprintf(pid_path, sizeof pid_path, "%s/nvidia-cuda-mps-control.pid", pipe_dir);
}

/* ------------------------------------------------------------ commands */

static int valid_percentage(const char *text, double *out)
{
    char *end;
    double value;
    if (text == NULL) {
        return 0;
    }
    value = strtod(text, &end);
    if (end == text || *end != '\0' || !(value > 0.0 && value <= 100.0)) {
        return 0;
    }
    *out = value;
    return 1;
}

static int valid_device(const char *text)
{
    return text != NULL && (strcmp(text, "0") == 0 || (*visible != '\0' && strcmp(text, visible) == 0));
}

static int valid_limit(const char *text)
{
    size_t digits;
    if (text == NULL) {
        return 0;
    }
    digits = strspn(text, "0123456789");
    if (digits == 0) {
        return 0;
    }
    return text[digits] == '\0' || (strchr("KMG", text[digits]) != NULL && text[digits + 1] == '\0');
}

static int is_server(const char *text)
{
    long pid = text != NULL ? strtol(text, NULL, 10) : 0;
    for (int i = 0; i < server_count; i++) {
        if (servers[i] == (pid_t)pid && pid > 0) {
            return 1;
        }
    }
    return 0;
}

static void stop_servers(void)
{
    for (int i = 0; i < server_count; i++) {
        kill(servers[i], SIGKILL);
        waitpid(servers[i], NULL, 0);
    }
    server_count = 0;
}

/* Answer one command line into answer; 1 when the daemon should quit. */
static int run_command(char *line, char *answer, size_t size)
{
    char *words[6] = {0};
    int count = 0;
    char *save = NULL;
    double percentage;
    answer[0] = '\0';
    log_line("Cmd: %s", line);
    record("command", line);
    for (char *word = strtok_r(line, " \t", &save); word != NULL && count < 6; word = strtok_r(NULL, " \t", &save)) {
        words[count++] = word;
    }
    if (count == 0) {
        return 0;
    }
    if (strcmp(words[0], "quit") == 0 && count == 1) {
        const char *ignore = getenv("FAKE_MPS_IGNORE_QUIT");
        return ignore == NULL || strcmp(ignore, "1") != 0;
    }
    if (strcmp(words[0], "get_server_list") == 0 && count == 1) {
        for (int i = 0; i < server_count; i++) {
            size_t used = strlen(answer);
            snprintf(answer + used, size - used, "%ld\n", (long)servers[i]);
        }
        return 0;
    }
    if (strcmp(words[0], "start_server") == 0 && count == 3 && strcmp(words[1], "-uid") == 0) {
        pid_t server;
        if (server_count >= MAX_SERVERS) {
            snprintf(answer, size, "Error: too many servers\n");
            return 0;
        }
        server = fork();
        if (server == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL); /* a killed daemon leaves no stand-in server behind */
            if (getppid() == 1) {
                _exit(0);
            }
            for (int fd = 3; fd < 1024; fd++) {
                close(fd); /* neither the listener nor this command's connection */
            }
            for (;;) {
                pause();
            }
        }
        servers[server_count++] = server;
        log_line("Server %ld started for uid %s", (long)server, words[2]);
        return 0;
    }
    if (strcmp(words[0], "set_default_active_thread_percentage") == 0 && count == 2) {
        if (!valid_percentage(words[1], &percentage)) {
            snprintf(answer, size, "Error: invalid percentage %s\n", words[1]);
            return 0;
        }
        default_percentage = percentage;
        return 0;
    }
    if (strcmp(words[0], "get_default_active_thread_percentage") == 0 && count == 1) {
        snprintf(answer, size, "%.1f\n", default_percentage);
        return 0;
    }
    if (strcmp(words[0], "set_default_device_pinned_mem_limit") == 0 && count == 3) {
        if (!valid_device(words[1]) || !valid_limit(words[2])) {
            snprintf(answer, size, "Error: invalid device or limit %s %s\n", words[1], words[2]);
            return 0;
        }
        if (strcmp(words[1], "0") == 0) {
            snprintf(default_limit, sizeof default_limit, "%s", words[2]);
        }
        return 0;
    }
    if (strcmp(words[0], "get_default_device_pinned_mem_limit") == 0 && count == 2) {
        if (!valid_device(words[1])) {
            snprintf(answer, size, "Error: invalid device %s\n", words[1]);
            return 0;
        }
        snprintf(answer, size, "%s\n", default_limit[0] != '\0' ? default_limit : "0");
        return 0;
    }
    if (strcmp(words[0], "set_active_thread_percentage") == 0 && count == 3) {
        if (!is_server(words[1]) || !valid_percentage(words[2], &percentage)) {
            snprintf(answer, size, "Error: invalid server or percentage %s %s\n", words[1], words[2]);
        }
        return 0;
    }
    if (strcmp(words[0], "set_device_pinned_mem_limit") == 0 && count == 4) {
        if (!is_server(words[1]) || !valid_device(words[2]) || !valid_limit(words[3])) {
            snprintf(answer, size, "Error: invalid server, device or limit %s %s %s\n", words[1], words[2], words[3]);
        }
        return 0;
    }
    snprintf(answer, size, "Error: unknown command %s\n", words[0]);
    return 0;
}

/* ------------------------------------------------------------ daemon */

static void on_term(int signal_number)
{
    (void)signal_number;
    stopping = 1;
}

static void serve(int listener)
{
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = on_term;
    sigaction(SIGTERM, &action, NULL);
    while (!stopping) {
        char line[1024];
        char answer[1024];
        size_t used = 0;
        ssize_t got;
        int quit;
        int client = accept(listener, NULL, NULL);
        if (client < 0) {
            if (errno == EINTR) {
                continue;
            }
            log_line("accept failed: %s", strerror(errno));
            break;
        }
        while (used < sizeof line - 1 && (got = read(client, line + used, sizeof line - 1 - used)) > 0) {
            used += (size_t)got;
        }
        line[used] = '\0';
        line[strcspn(line, "\r\n")] = '\0';
        quit = run_command(line, answer, sizeof answer);
        if (write(client, answer, strlen(answer)) < 0) {
            log_line("answer lost: %s", strerror(errno));
        }
        close(client);
        if (quit) {
            break;
        }
    }
    stop_servers();
    unlink(socket_path);
    unlink(pid_path);
    log_line("Control daemon exiting");
    exit(0);
}

static int fail_start(const char *format, ...)
{
    char text[1024];
    va_list args;
    va_start(args, format);
    vsnprintf(text, sizeof text, format, args);
    va_end(args);
    log_line("%s", text);
    fprintf(stderr, "%s\n", text);
    return 1;
}

static int start_daemon(void)
{
    char path[600];
    struct sockaddr_un address;
    int listener;
    int ready[2];
    pid_t daemon_pid;
    const char *fail = getenv("FAKE_MPS_FAIL");
    snprintf(path, sizeof path, "%s/control.log", log_dir);
    control_log = fopen(path, "a");
    if (fail != NULL && *fail != '\0') {
        const char *colon = strchr(fail, ':');
        int code = atoi(fail);
        log_line("%s", colon != NULL ? colon + 1 : fail);
        fprintf(stderr, "%s\n", colon != NULL ? colon + 1 : fail);
        return code;
    }
    if (control_log == NULL) {
        fprintf(stderr, "cannot open the log %s: %s\n", path, strerror(errno));
        return 1;
    }
    listener = socket(AF_UNIX, SOCK_STREAM, 0);
    memset(&address, 0, sizeof address);
    address.sun_family = AF_UNIX;
    if (strlen(socket_path) >= sizeof address.sun_path) {
        return fail_start("the pipe directory %s is too long for a socket", pipe_dir);
    }
    memcpy(address.sun_path, socket_path, strlen(socket_path) + 1);
    unlink(socket_path); /* a daemon killed before left it behind */
    if (listener < 0 || bind(listener, (struct sockaddr *)&address, sizeof address) != 0 || listen(listener, 16) != 0) {
        return fail_start("cannot create %s: %s", socket_path, strerror(errno));
    }
    if (pipe(ready) != 0) {
        return fail_start("pipe: %s", strerror(errno));
    }
    daemon_pid = fork();
    if (daemon_pid < 0) {
        return fail_start("fork: %s", strerror(errno));
    }
    if (daemon_pid == 0) {
        FILE *pid_file;
        int null = open("/dev/null", O_RDWR);
        char pid_text[32];
        close(ready[0]);
        setsid();
        if (null >= 0) {
            dup2(null, 0);
            dup2(null, 1);
            dup2(null, 2);
        }
        pid_file = fopen(pid_path, "w");
        if (pid_file == NULL) {
            log_line("cannot write %s: %s", pid_path, strerror(errno));
            exit(1); /* the writer end closes: the first process reports it */
        }
        fprintf(pid_file, "%ld\n", (long)getpid());
        fclose(pid_file);
        log_line("Starting control daemon using socket %s", socket_path);
        snprintf(pid_text, sizeof pid_text, "%ld", (long)getpid());
        record("start", pid_text);
        {
            struct stat shm;
            char identity[64] = "none";
            if (stat("/dev/shm", &shm) == 0) {
                snprintf(identity, sizeof identity, "%lu:%lu", (unsigned long)shm.st_dev, (unsigned long)shm.st_ino);
            }
            record("shm", identity);
        }
        if (write(ready[1], "1", 1) != 1) {
            exit(1);
        }
        close(ready[1]);
        serve(listener);
    }
    close(ready[1]);
    close(listener);
    {
        char byte;
        if (read(ready[0], &byte, 1) != 1) {
            fprintf(stderr, "the control daemon did not start: cannot write %s\n", pid_path);
            return 1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------ client */

static int client(void)
{
    char line[1024];
    while (fgets(line, sizeof line, stdin) != NULL) {
        struct sockaddr_un address;
        char answer[1024];
        ssize_t got;
        int connection;
        line[strcspn(line, "\r\n")] = '\0';
        if (line[0] == '\0') {
            continue;
        }
        connection = socket(AF_UNIX, SOCK_STREAM, 0);
        memset(&address, 0, sizeof address);
        address.sun_family = AF_UNIX;
        if (strlen(socket_path) >= sizeof address.sun_path) {
            fprintf(stderr, "the pipe directory %s is too long for a socket\n", pipe_dir);
            return 1;
        }
        memcpy(address.sun_path, socket_path, strlen(socket_path) + 1);
        if (connection < 0 || connect(connection, (struct sockaddr *)&address, sizeof address) != 0) {
            fprintf(stderr, "cannot reach the MPS control daemon at %s: %s\n", socket_path, strerror(errno));
            return 1;
        }
        if (write(connection, line, strlen(line)) < 0) {
            fprintf(stderr, "cannot send to the MPS control daemon: %s\n", strerror(errno));
            return 1;
        }
        shutdown(connection, SHUT_WR);
        while ((got = read(connection, answer, sizeof answer)) > 0) {
            fwrite(answer, 1, (size_t)got, stdout);
        }
        fflush(stdout);
        close(connection);
    }
    return 0;
}

int main(int argc, char **argv)
{
    read_environment();
    if (argc == 2 && strcmp(argv[1], "-d") == 0) {
        return start_daemon();
    }
    if (argc == 1) {
        return client();
    }
    fprintf(stderr, "usage: %s [-d]\n", argv[0]);
    return 2;
}
