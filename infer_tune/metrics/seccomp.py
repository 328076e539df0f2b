"""The seccomp filter of the generated-code sandbox (metrics/sandbox.py): a classic BPF program that
bubblewrap installs (`--seccomp FD`) just before it runs the program.

Assembled here with `struct` instead of through libseccomp: the filter is one fixed deny list on two
architectures, and a Python binding would add a system library to every install for ~40 instructions.
The program, in order:

1. the calling convention's architecture is not this machine's (x86-64 or AArch64) -> kill the
   process (no i386 / compat-syscall way around the list);
2. x86-64 only: an x32 syscall number (bit 30 set) -> EPERM;
3. `clone` with any CLONE_NEW* flag -> EPERM (no namespace from a plain fork either);
4. `clone3` -> ENOSYS (its flags sit in memory a filter cannot read; the C library then falls back
   to `clone`, which step 3 checks);
5. a syscall of DENIED -> EPERM; anything else is allowed.

DENIED: new namespaces or mounts (unshare, setns, mount, umount2, pivot_root, chroot, the new mount
API), keyrings (keyctl, add_key, request_key: nothing carried between runs), System V IPC (shm*,
msg*, sem*: memory that outlives the process), process inspection (ptrace, process_vm_*, kcmp,
perf_event_open), bpf, userfaultfd, io_uring (it bypasses seccomp for what it does), modules, kexec,
swap, reboot, acct.
"""

from __future__ import annotations

import platform
import struct

DENIED = ("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
          "fsconfig", "fsmount", "fspick", "mount_setattr", "keyctl", "add_key", "request_key", "shmget", "shmat",
          "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semctl", "semtimedop", "ptrace",
          "process_vm_readv", "process_vm_writev", "kcmp", "perf_event_open", "bpf", "userfaultfd",
          "io_uring_setup", "io_uring_enter", "io_uring_register", "init_module", "finit_module", "delete_module",
          "kexec_load", "kexec_file_load", "swapon", "swapoff", "reboot", "acct")

# Syscall numbers (Linux UAPI: arch/x86/entry/syscalls/syscall_64.tbl; include/uapi/asm-generic/unistd.h).
_X86_64 = dict(unshare=272, setns=308, mount=165, umount2=166, pivot_root=155, chroot=161, keyctl=250, add_key=248,
               request_key=249, shmget=29, shmat=30, shmctl=31, msgget=68, msgsnd=69, msgrcv=70, msgctl=71,
               semget=64, semop=65, semctl=66, semtimedop=220, ptrace=101, process_vm_readv=310,
               process_vm_writev=311, kcmp=312, perf_event_open=298, bpf=321, userfaultfd=323, init_module=175,
               finit_module=313, delete_module=176, kexec_load=246, kexec_file_load=320, swapon=167, swapoff=168,
               reboot=169, acct=163, clone=56, clone3=435)
_AARCH64 = dict(unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, chroot=51, keyctl=219, add_key=217,
                request_key=218, shmget=194, shmat=196, shmctl=195, msgget=186, msgsnd=189, msgrcv=188, msgctl=187,
                semget=190, semop=193, semctl=191, semtimedop=192, ptrace=117, process_vm_readv=270,
                process_vm_writev=271, kcmp=272, perf_event_open=241, bpf=280, userfaultfd=282, init_module=105,
                finit_module=273, delete_module=106, kexec_load=104, kexec_file_load=294, swapon=224, swapoff=225,
                reboot=142, acct=89, clone=220, clone3=435)
_SHARED = dict(open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
               io_uring_setup=425, io_uring_enter=426, io_uring_register=427)  # one table for every architecture
ARCHES = {"x86_64": (0xC000003E, {**_X86_64, **_SHARED}), "aarch64": (0xC00000B7, {**_AARCH64, **_SHARED})}

CLONE_NEW_FLAGS = 0x7E020080  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
X32_SYSCALL_BIT = 0x40000000
EPERM, ENOSYS = 1, 38

# classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h)
LD_ABS_W, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
OFF_NR, OFF_ARCH, OFF_ARG0 = 0, 4, 16  # struct seccomp_data: nr, arch, instruction_pointer, args[6]


class Unsupported(Exception):
    """No syscall table for this machine's architecture."""


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(machine: str | None = None) -> bytes:
    """The filter as bytes of `struct sock_filter` (what `bwrap --seccomp FD` reads)."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise Unsupported(f"no seccomp syscall table for {machine} (have {', '.join(ARCHES)})")
    audit_arch, numbers = ARCHES[machine]
    denied = sorted({numbers[name] for name in DENIED})
    body: list[bytes] = [_insn(LD_ABS_W, OFF_ARCH), _insn(JEQ_K, audit_arch, jt=1), _insn(RET_K, RET_KILL_PROCESS),
                         _insn(LD_ABS_W, OFF_NR)]
    if machine == "x86_64":
        body += [_insn(JGE_K, X32_SYSCALL_BIT, jf=1), _insn(RET_K, RET_ERRNO | EPERM)]
    # clone: load its flags (low 32 bits of args[0]), refuse any CLONE_NEW*, reload the number
    body += [_insn(JEQ_K, numbers["clone"], jf=4), _insn(LD_ABS_W, OFF_ARG0), _insn(JSET_K, CLONE_NEW_FLAGS, jf=1),
             _insn(RET_K, RET_ERRNO | EPERM), _insn(LD_ABS_W, OFF_NR)]
    body += [_insn(JEQ_K, numbers["clone3"], jf=1), _insn(RET_K, RET_ERRNO | ENOSYS)]
    for k, nr in enumerate(denied):  # each match jumps to the shared EPERM at the end
        body.append(_insn(JEQ_K, nr, jt=len(denied) - k))
    body += [_insn(RET_K, RET_ALLOW), _insn(RET_K, RET_ERRNO | EPERM)]
    return b"".join(body)
