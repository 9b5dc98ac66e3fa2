/*
 * bsr_fs_read.c: the filesystem tier's object reads and probes, many objects per call
 * (bsr_runtime/tiers/fs_native.py).
 *
 * Why in C: read one object at a time from Python and every open, fstat, read and close releases
 * and takes back the GIL; while the engine's step thread runs Python each take-back can wait a
 * switch interval, so a restore running beside the engine pays per object, not per window. Here a
 * window's objects are read in one call that releases the GIL once (ctypes).
 *
 * The same rules as the Python path (fs_open.py): each object is opened with one
 * openat2(root_fd, "ab/cd/<hash>.bsr", RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH)
 * and the caller's flags (O_NOFOLLOW | O_NONBLOCK, so a FIFO never blocks), must be a regular file of
 * exactly object_size bytes, and is read whole (short reads retried from where they stopped). What
 * an object's header means is checked by the caller; this file only moves bytes and reports per object.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "bsr_abi.h"

#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#define RESOLVE_NO_MAGICLINKS_ 0x02
#define RESOLVE_NO_SYMLINKS_ 0x04
#define RESOLVE_BENEATH_ 0x08

struct open_how_ {
    uint64_t flags, mode, resolve;
};

static int open_beneath(int root_fd, const char* relpath, int64_t flags) {
    struct open_how_ how = {(uint64_t)flags, 0,
                            RESOLVE_NO_SYMLINKS_ | RESOLVE_NO_MAGICLINKS_ | RESOLVE_BENEATH_};
    long fd;
    do {
        fd = syscall(SYS_openat2, root_fd, relpath, &how, sizeof how);
    } while (fd < 0 && errno == EINTR);
    return fd < 0 ? -errno : (int)fd;
}

/* Bytes read into head then body from offset 0, until both are full or EOF. */
static int64_t read_whole(int fd, uint8_t* head, int64_t head_bytes, uint8_t* body, int64_t body_bytes) {
    int64_t total = 0, want = head_bytes + body_bytes;
    while (total < want) {
        struct iovec iov[2];
        int cnt = 0;
        if (total < head_bytes) iov[cnt++] = (struct iovec){head + total, (size_t)(head_bytes - total)};
        int64_t in_body = total > head_bytes ? total - head_bytes : 0;
        iov[cnt++] = (struct iovec){body + in_body, (size_t)(body_bytes - in_body)};
        ssize_t n = preadv(fd, iov, cnt, (off_t)total);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -errno;
        if (n == 0) break;
        total += n;
    }
    return total;
}

static int64_t read_one(int root_fd, const char* relpath, int64_t flags, int64_t object_size, uint8_t* head,
                        int64_t head_bytes, uint8_t* body, uint32_t* crc) {
    int fd = open_beneath(root_fd, relpath, flags);
    if (fd < 0) return -fd;
    struct stat st;
    int64_t status = 0;
    if (fstat(fd, &st) != 0) {
        status = errno;
    } else if (!S_ISREG(st.st_mode)) {
        status = BSR_FS_NOT_REGULAR;
    } else if ((int64_t)st.st_size != object_size) {
        status = BSR_FS_WRONG_SIZE;
    } else {
        int64_t got = read_whole(fd, head, head_bytes, body, object_size - head_bytes);
        if (got < 0)
            status = -got;
        else if (got != object_size)
            status = BSR_FS_SHORT;
        else
            *crc = bsr_crc32c(0, body, object_size - head_bytes);
    }
    close(fd);
    return status;
}

BSR_CPU_API int bsr_fs_read_objects(int root_fd, int64_t n, const int64_t* relpaths, int64_t flags,
                                    int64_t object_size, int64_t head_bytes, void* heads, const int64_t* bodies,
                                    uint32_t* crcs, int64_t* status) {
    if (n < 0 || head_bytes < 0 || object_size < head_bytes ||
        (n > 0 && (!relpaths || !heads || !bodies || !crcs || !status)))
        return -1;
    for (int64_t i = 0; i < n; ++i) {
        crcs[i] = 0;
        status[i] = read_one(root_fd, (const char*)(intptr_t)relpaths[i], flags, object_size,
                             (uint8_t*)heads + i * head_bytes, head_bytes, (uint8_t*)(intptr_t)bodies[i], &crcs[i]);
    }
    return 0;
}

BSR_CPU_API int bsr_fs_probe_objects(int root_fd, int64_t n, const int64_t* relpaths, int64_t flags,
                                     int64_t object_size, int64_t* status) {
    if (n < 0 || (n > 0 && (!relpaths || !status))) return -1;
    for (int64_t i = 0; i < n; ++i) {
        int fd = open_beneath(root_fd, (const char*)(intptr_t)relpaths[i], flags);
        if (fd < 0) {
            status[i] = -fd;
            continue;
        }
        struct stat st;
        if (fstat(fd, &st) != 0)
            status[i] = errno;
        else if (!S_ISREG(st.st_mode))
            status[i] = BSR_FS_NOT_REGULAR;
        else if ((int64_t)st.st_size != object_size)
            status[i] = BSR_FS_WRONG_SIZE;
        else
            status[i] = 0;
        close(fd);
    }
    return 0;
}
