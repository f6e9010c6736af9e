/* What a command could do to a process of its own user it may ptrace (issue 25, finding 6).
   ptrace_open PID PATH...: attach to PID, make it call openat(AT_FDCWD, PATH, O_RDWR) for each
   PATH (closing what it opened) -- the kernel judges that open by PID's cgroup, not ours -- print
   "PATH errno" (0: opened; "attach ERRNO" when PID cannot be traced), restore it and detach.
   x86-64 only (it borrows the instruction at PID's program counter for one syscall). */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/user.h>
#include <sys/wait.h>

static long call(pid_t pid, struct user_regs_struct *saved, long nr, long a, long b, long c) {
    struct user_regs_struct regs = *saved;
    regs.rax = nr; regs.orig_rax = nr; regs.rdi = a; regs.rsi = b; regs.rdx = c;
    unsigned long at = saved->rip;
    errno = 0;
    long word = ptrace(PTRACE_PEEKTEXT, pid, (void *)at, 0);
    if (errno) return -1000;
    long patched = (word & ~0xffffL) | 0x050f; /* syscall */
    ptrace(PTRACE_POKETEXT, pid, (void *)at, (void *)patched);
    ptrace(PTRACE_SETREGS, pid, 0, &regs);
    ptrace(PTRACE_SINGLESTEP, pid, 0, 0);
    int status; waitpid(pid, &status, 0);
    struct user_regs_struct out; ptrace(PTRACE_GETREGS, pid, 0, &out);
    ptrace(PTRACE_POKETEXT, pid, (void *)at, (void *)word);
    ptrace(PTRACE_SETREGS, pid, 0, saved);
    return (long)out.rax;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: ptrace_open PID PATH...\n"); return 2; }
    pid_t pid = atoi(argv[1]);
    if (ptrace(PTRACE_ATTACH, pid, 0, 0) != 0) { printf("attach %d\n", errno); return 1; }
    int status; waitpid(pid, &status, 0);
    struct user_regs_struct saved; ptrace(PTRACE_GETREGS, pid, 0, &saved);
    for (int i = 2; i < argc; i++) {
        size_t n = strlen(argv[i]) + 1, words = (n + 7) / 8;
        unsigned long where = (saved.rsp - 1024 - words * 8) & ~7UL;  /* below the red zone */
        for (size_t w = 0; w < words; w++) {
            long v = 0; memcpy(&v, argv[i] + w * 8, (n - w * 8) < 8 ? (n - w * 8) : 8);
            ptrace(PTRACE_POKEDATA, pid, (void *)(where + w * 8), (void *)v);
        }
        long fd = call(pid, &saved, SYS_openat, AT_FDCWD, (long)where, O_RDWR);
        if (fd >= 0) call(pid, &saved, SYS_close, fd, 0, 0);
        printf("%s %ld\n", argv[i], fd >= 0 ? 0 : -fd);
    }
    ptrace(PTRACE_DETACH, pid, 0, 0);
    return 0;
}
