"""The sandbox's first process: builds the sandbox's file system, then runs the test harness in it
as an unprivileged user under resource limits. Standard library only; run by `rlmesh.reward_server.
sandbox` as `unshare [--user --map-root-user] --mount --net --pid --ipc --uts --fork --kill-child
python -I -S <this file> ROOT`, so it is process 1 of fresh mount, network, pid, IPC and UTS
namespaces, as root (real root, or root of a fresh user namespace when the reward server is not
root).

It reads one JSON job from stdin (`program`, `harness`, `spec`, `limits`, `binds`, `python`) and:
1. mounts a small tmpfs on ROOT (an empty directory, private to this mount namespace, so the host
   never sees what is mounted there) and builds a root in it: read-only bind mounts of the system
   library directories and the Python installation, `/dev/{null,zero,random,urandom}`, `/etc/ld.so.
   cache`, and `/sandbox`, a tmpfs of `limits.work_mb` owned by the sandbox user; nothing else of the
   host (no `/etc/passwd`, no `/home`, `/root` beyond the Python prefix, `/tmp`, `/proc`, the run
   directory); then makes the root itself read-only and `chroot`s into it;
2. forks the harness: resource limits (CPU seconds, address space, processes, file size, open
   files, no core files), no_new_privs, then either `setgroups([])`, `setgid`/`setuid` to
   `limits.uid` (real root), or, in a user namespace (`limits.uid` null), every capability dropped
   (bounding, inheritable, permitted, ambient): either way root's privileges are gone for good, so
   the chroot cannot be undone (the kernel also refuses a chrooted process a new user namespace);
   cwd `/sandbox`, a minimal environment; the job's `spec` arrives on the harness's stdin;
3. waits for it and exits with its status. Process 1 exiting makes the kernel kill every process
   left in the pid namespace (a fork bomb's children included).
"""

import ctypes
import json
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
_libc = ctypes.CDLL(None, use_errno=True)


def drop_all_capabilities():
    """Leave the process, and whatever it executes, without capabilities (for root of a user
    namespace, which cannot switch to another uid)."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: no such cap
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words, all empty
    if _libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def bind_readonly(source, target, is_file=False):
    if is_file:
        open(target, "w").close()
    else:
        os.makedirs(target, exist_ok=True)
    mount(source, target, None, MS_BIND)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)


def build_root(root, job):
    limits = job["limits"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    for path in job["binds"]:
        target = root + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin, /lib -> usr/lib, ...
            os.symlink(os.readlink(path), target)
        elif os.path.exists(path):
            bind_readonly(path, target, is_file=not os.path.isdir(path))
    os.makedirs(root + "/dev")
    for dev in ("null", "zero", "random", "urandom"):
        open(f"{root}/dev/{dev}", "w").close()
        mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, MS_BIND)
    work = root + "/sandbox"
    os.makedirs(work)
    uid = limits["uid"]
    owner = "" if uid is None else f",uid={uid},gid={uid}"
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={limits['work_mb']}m,mode=0700{owner}")
    with open(work + "/solution.py", "w") as f:
        f.write(job["program"])
    if uid is not None:
        os.chown(work + "/solution.py", uid, uid)
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    os.chroot(root)
    os.chdir("/sandbox")


def run_harness(job):
    limits = job["limits"]
    spec_r, spec_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(spec_r, 0)
            os.close(spec_r)
            os.close(spec_w)
            mib = 1 << 20
            for rlimit, value in ((resource.RLIMIT_CPU, limits["cpu_s"]), (resource.RLIMIT_AS, limits["memory_mb"] * mib),
                                  (resource.RLIMIT_NPROC, limits["max_processes"]),
                                  (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mib),
                                  (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
                resource.setrlimit(rlimit, (value, value))
            if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
            uid = limits["uid"]
            if uid is None:
                drop_all_capabilities()
            else:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            env = {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox", "LANG": "C.UTF-8",
                   "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
            os.execve(job["python"], [job["python"], "-I", "-S", "-c", job["harness"]], env)
        except BaseException as err:  # noqa: BLE001 - report any failure to start, then die
            os.write(2, f"sandbox: cannot start the harness: {type(err).__name__}: {err}\n".encode())
        os._exit(127)
    os.close(spec_r)
    with os.fdopen(spec_w, "w") as f:
        try:
            f.write(json.dumps(job["spec"]))
        except BrokenPipeError:
            pass
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main():
    job = json.loads(sys.stdin.read())
    try:
        build_root(sys.argv[1], job)
    except OSError as err:
        sys.stderr.write(f"sandbox: cannot build the sandbox root: {err}\n")
        return 126
    sys.stdout.flush()
    code = run_harness(job)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
