/* A store-read TCP Get from NVMe with no Python on either end: the floor a compiled data plane could reach here.
 *
 *   tcp_floor PATH BLOCK ROUNDS PIECE READERS      (built and run by `python -m bench.nvme_native_floor`)
 *   tcp_floor --crc FILE                           (prints the CRC32C of FILE's bytes, in hex)
 *
 * PATH gets 3 * ROUNDS prefix extents of 32 records (a 4 KiB header page, then BLOCK bytes of random payload,
 * as the NVMe tier lays a prefix down), written interleaved with O_DIRECT and fsynced. Then a server process
 * (forked, a loopback TCP connection) serves Gets, and the client takes three steps a round, in a rotating order,
 * each on an extent of its own read once:
 *   raw:    the client's own O_DIRECT pread of an extent (the baseline);
 *   serial: the server reads the extent in one pread, checks its 32 CRC32Cs, then writev's the payloads;
 *   piped:  the server reads pieces of whole records (at most PIECE bytes or one record, about equal, as the tier
 *           cuts a run; READERS threads with a read in flight each) while its serving thread checks and sends the
 *           pieces before, in order;
 * and in both Gets the client receives each block into its place in a 32-block buffer and checks its CRC32C
 * as it lands. One JSON object on stdout: the milliseconds of every step, both processes' CPU per Get.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096
#define PREFIX 32
#define LANE 4096 /* bytes per stream in the three-stream CRC32C */
#define MAX_SLOTS 16
#define RECV_PIECE (256 << 10) /* the TCP lane's framing.PIECE, LOWAT and SOCKET_BUFFER */
#define LOWAT (1 << 20)
#define SOCKET_BUFFER (4 << 20)

static void die(const char *what) {
    perror(what);
    exit(2);
}

/* CRC32C (Castagnoli) with the SSE4.2 instruction, three independent streams joined by a table that advances a
 * register over LANE zero bytes: crc(r, A|B) = Z(crc(r, A)) ^ crc(0, B), the register's update being linear. */
static uint32_t zero_lane[4][256];

static uint32_t crc_raw(uint32_t r, const uint8_t *p, size_t n) {
    uint64_t w;
    for (; n >= 8; p += 8, n -= 8) {
        memcpy(&w, p, 8);
        r = (uint32_t)__builtin_ia32_crc32di(r, w);
    }
    for (; n; n--) r = __builtin_ia32_crc32qi(r, *p++);
    return r;
}

static uint32_t advance(uint32_t r) {
    return zero_lane[0][r & 255] ^ zero_lane[1][(r >> 8) & 255] ^ zero_lane[2][(r >> 16) & 255] ^
           zero_lane[3][r >> 24];
}

static void crc_init(void) {
    static const uint8_t zeros[LANE];
    uint32_t column[32];
    for (int i = 0; i < 32; i++) column[i] = crc_raw(1u << i, zeros, LANE);
    for (int k = 0; k < 4; k++)
        for (int v = 0; v < 256; v++) {
            uint32_t t = 0;
            for (int b = 0; b < 8; b++)
                if (v >> b & 1) t ^= column[8 * k + b];
            zero_lane[k][v] = t;
        }
}

/* The CRC32C of `crc`'s bytes followed by p[0:n] (crc 0: of p alone). */
static uint32_t crc32c_more(uint32_t crc, const uint8_t *p, size_t n) {
    uint32_t r = ~crc;
    uint64_t x, y, z;
    for (; n >= 3 * LANE; p += 3 * LANE, n -= 3 * LANE) {
        uint32_t a = r, b = 0, c = 0;
        for (size_t i = 0; i < LANE; i += 8) {
            memcpy(&x, p + i, 8);
            memcpy(&y, p + LANE + i, 8);
            memcpy(&z, p + 2 * LANE + i, 8);
            a = (uint32_t)__builtin_ia32_crc32di(a, x);
            b = (uint32_t)__builtin_ia32_crc32di(b, y);
            c = (uint32_t)__builtin_ia32_crc32di(c, z);
        }
        r = advance(advance(a) ^ b) ^ c;
    }
    return ~crc_raw(r, p, n);
}

static uint32_t crc32c(const uint8_t *p, size_t n) { return crc32c_more(0, p, n); }

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static double cpu_ms(int who) {
    struct rusage u;
    getrusage(who, &u);
    return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e3;
}

/* Huge pages where the kernel gives them, as kvstore.hugepages.huge_buffer: an O_DIRECT read into 4 KiB pages
 * ran at half the speed on this VM's disk (512 pages to pin and map a 2 MiB read instead of one). */
static uint8_t *aligned(size_t n) {
    void *p;
    n = (n + (2 << 20) - 1) & ~(size_t)((2 << 20) - 1); /* whole huge pages: a part of one is mapped in 4 KiB */
    if (posix_memalign(&p, 2 << 20, n)) die("posix_memalign");
    madvise(p, n, MADV_HUGEPAGE); /* advice: a refusal changes nothing */
    memset(p, 0, n);              /* fault every page in before anything is timed */
    return p;
}

static void full_pread(int fd, uint8_t *buf, size_t n, off_t at) {
    while (n) {
        ssize_t got = pread(fd, buf, n, at);
        if (got <= 0) die("pread");
        buf += got, n -= (size_t)got, at += got;
    }
}

static void full_write(int fd, const void *buf, size_t n) {
    const uint8_t *p = buf;
    while (n) {
        ssize_t put = write(fd, p, n);
        if (put <= 0) die("write");
        p += put, n -= (size_t)put;
    }
}

static void full_writev(int fd, struct iovec *iov, int count) {
    while (count) {
        ssize_t put = writev(fd, iov, count);
        if (put <= 0) die("writev");
        while (count && (size_t)put >= iov->iov_len) put -= (ssize_t)iov->iov_len, iov++, count--;
        if (count) iov->iov_base = (uint8_t *)iov->iov_base + put, iov->iov_len -= (size_t)put;
    }
}

static size_t block_bytes, record_bytes, extent_bytes, records_per_piece, pieces;
static int readers;
static uint32_t *crcs; /* [extent][PREFIX] */

struct request {
    int64_t extent; /* -1: stop */
    int32_t piped;
    int32_t pad;
};

/* The server's reading threads and the serving thread share slots of one piece each, piece p in slot p % slots. */
static struct {
    int fd, slots;
    uint8_t *buf[MAX_SLOTS];
    sem_t free_[MAX_SLOTS], ready[MAX_SLOTS], start[MAX_SLOTS];
    int64_t extent;
} srv;

static size_t piece_records(size_t p) {
    size_t left = PREFIX - p * records_per_piece;
    return left < records_per_piece ? left : records_per_piece;
}

static void *reader_main(void *arg) {
    int t = (int)(intptr_t)arg;
    for (;;) {
        sem_wait(&srv.start[t]);
        if (srv.extent < 0) return NULL;
        for (size_t p = (size_t)t; p < pieces; p += (size_t)readers) {
            int s = (int)(p % (size_t)srv.slots);
            sem_wait(&srv.free_[s]);
            off_t at = (off_t)(srv.extent * (int64_t)extent_bytes) + (off_t)(p * records_per_piece * record_bytes);
            full_pread(srv.fd, srv.buf[s], piece_records(p) * record_bytes, at);
            sem_post(&srv.ready[s]);
        }
    }
}

/* Checks the records of one piece (first record `first`) and sends their payloads. */
static void check_and_send(int sock, const uint8_t *buf, int64_t extent, size_t first, size_t count) {
    struct iovec iov[PREFIX];
    for (size_t k = 0; k < count; k++) {
        const uint8_t *payload = buf + k * record_bytes + PAGE;
        if (crc32c(payload, block_bytes) != crcs[extent * PREFIX + (int64_t)(first + k)]) {
            fprintf(stderr, "server: CRC32C mismatch, extent %lld record %zu\n", (long long)extent, first + k);
            exit(3);
        }
        iov[k].iov_base = (void *)payload;
        iov[k].iov_len = block_bytes;
    }
    full_writev(sock, iov, (int)count);
}

static void serve(int sock) {
    pthread_t threads[MAX_SLOTS];
    for (int s = 0; s < srv.slots; s++) {
        srv.buf[s] = aligned(records_per_piece * record_bytes);
        sem_init(&srv.free_[s], 0, 1);
        sem_init(&srv.ready[s], 0, 0);
    }
    uint8_t *whole = aligned(extent_bytes);
    for (int t = 0; t < readers; t++) {
        sem_init(&srv.start[t], 0, 0);
        pthread_create(&threads[t], NULL, reader_main, (void *)(intptr_t)t);
    }
    struct request req;
    for (;;) {
        if (recv(sock, &req, sizeof req, MSG_WAITALL) != sizeof req) die("server recv");
        if (req.extent < 0) break;
        if (!req.piped) {
            full_pread(srv.fd, whole, extent_bytes, (off_t)(req.extent * (int64_t)extent_bytes));
            check_and_send(sock, whole, req.extent, 0, PREFIX);
            continue;
        }
        srv.extent = req.extent;
        for (int t = 0; t < readers; t++) sem_post(&srv.start[t]);
        for (size_t p = 0; p < pieces; p++) {
            int s = (int)(p % (size_t)srv.slots);
            sem_wait(&srv.ready[s]);
            check_and_send(sock, srv.buf[s], req.extent, p * records_per_piece, piece_records(p));
            sem_post(&srv.free_[s]);
        }
    }
    srv.extent = -1;
    for (int t = 0; t < readers; t++) sem_post(&srv.start[t]);
    for (int t = 0; t < readers; t++) pthread_join(threads[t], NULL);
    double cpu = cpu_ms(RUSAGE_SELF);
    full_write(sock, &cpu, sizeof cpu);
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static void fill_random(uint8_t *p, size_t n) {
    for (size_t i = 0; i + 8 <= n; i += 8) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        memcpy(p + i, &rng, 8);
    }
}

static void write_extents(const char *path, int64_t extents) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0600);
    if (fd < 0) die("open for writing");
    uint8_t *buf = aligned(extent_bytes);
    for (int64_t e = 0; e < extents; e++) {
        fill_random(buf, extent_bytes);
        for (int k = 0; k < PREFIX; k++)
            crcs[e * PREFIX + k] = crc32c(buf + (size_t)k * record_bytes + PAGE, block_bytes);
        size_t done = 0;
        while (done < extent_bytes) {
            ssize_t put = pwrite(fd, buf + done, extent_bytes - done, (off_t)(e * (int64_t)extent_bytes) + (off_t)done);
            if (put <= 0) die("pwrite");
            done += (size_t)put;
        }
    }
    if (fsync(fd)) die("fsync");
    close(fd);
    free(buf);
}

static void set_lowat(int sock, int bytes) {
    if (setsockopt(sock, SOL_SOCKET, SO_RCVLOWAT, &bytes, sizeof bytes)) die("SO_RCVLOWAT");
}

/* As the TCP lane's client receives (kvstore/lanes/framing.py): each block into its place in pieces of RECV_PIECE
 * bytes, each checked while it is in cache, and SO_RCVLOWAT at LOWAT while that much is still to come after the
 * piece being received, so the kernel wakes the client once a LOWAT, not once a segment. */
static double client_get(int sock, uint8_t *dst, int64_t extent, int piped) {
    struct request req = {extent, piped, 0};
    size_t to_come = PREFIX * block_bytes;
    int lowat = to_come > RECV_PIECE + LOWAT;
    double t0 = now_ms();
    full_write(sock, &req, sizeof req);
    if (lowat) set_lowat(sock, LOWAT);
    for (int k = 0; k < PREFIX; k++) {
        uint8_t *block = dst + (size_t)k * block_bytes;
        uint32_t crc = 0;
        for (size_t at = 0; at < block_bytes; at += RECV_PIECE) {
            size_t n = block_bytes - at < RECV_PIECE ? block_bytes - at : RECV_PIECE;
            to_come -= n;
            if (lowat && to_come < LOWAT) set_lowat(sock, 1), lowat = 0;
            ssize_t got = recv(sock, block + at, n, MSG_WAITALL);
        if (got == 0) {
            fprintf(stderr, "client: the server closed the connection mid-Get (its error is above)\n");
            exit(3);
        }
        if (got != (ssize_t)n) die("client recv");
            crc = crc32c_more(crc, block + at, n);
        }
        if (crc != crcs[extent * PREFIX + k]) {
            fprintf(stderr, "client: CRC32C mismatch, extent %lld block %d\n", (long long)extent, k);
            exit(3);
        }
    }
    return now_ms() - t0;
}

/* As kvstore.lanes.framing.tune: no Nagle delay, 4 MiB socket buffers. */
static void tune(int sock) {
    int one = 1, buffer = SOCKET_BUFFER;
    setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(sock, SOL_SOCKET, SO_SNDBUF, &buffer, sizeof buffer);
    setsockopt(sock, SOL_SOCKET, SO_RCVBUF, &buffer, sizeof buffer);
}

static void print_list(const char *name, const double *v, int n, const char *end) {
    printf("\"%s\": [", name);
    for (int i = 0; i < n; i++) printf("%s%.4f", i ? ", " : "", v[i]);
    printf("]%s", end);
}

int main(int argc, char **argv) {
    crc_init();
    if (argc == 3 && !strcmp(argv[1], "--crc")) {
        FILE *f = fopen(argv[2], "rb");
        if (!f) die("open");
        fseek(f, 0, SEEK_END);
        size_t n = (size_t)ftell(f);
        uint8_t *data = malloc(n + 1);
        rewind(f);
        if (fread(data, 1, n, f) != n) die("read");
        printf("%08x\n", crc32c(data, n));
        return 0;
    }
    if (argc != 6) {
        fprintf(stderr, "usage: %s PATH BLOCK ROUNDS PIECE READERS | --crc FILE\n", argv[0]);
        return 1;
    }
    const char *path = argv[1];
    block_bytes = strtoull(argv[2], NULL, 10);
    int rounds = atoi(argv[3]);
    size_t piece = strtoull(argv[4], NULL, 10);
    readers = atoi(argv[5]);
    if (!block_bytes || block_bytes % PAGE || rounds < 1 || readers < 1 || readers > MAX_SLOTS / 2) {
        fprintf(stderr, "BLOCK must be a multiple of 4096, ROUNDS >= 1, READERS in 1..%d\n", MAX_SLOTS / 2);
        return 1;
    }
    record_bytes = PAGE + block_bytes;
    extent_bytes = PREFIX * record_bytes;
    records_per_piece = piece / record_bytes ? piece / record_bytes : 1;
    if (records_per_piece > PREFIX) records_per_piece = PREFIX;
    pieces = (PREFIX + records_per_piece - 1) / records_per_piece;
    records_per_piece = (PREFIX + pieces - 1) / pieces; /* about equal pieces, as the tier cuts a run */
    pieces = (PREFIX + records_per_piece - 1) / records_per_piece;
    int64_t extents = 3 * (int64_t)rounds;
    crcs = malloc(sizeof(uint32_t) * (size_t)extents * PREFIX);

    /* What one stream of this CRC32C does on this CPU, beside the steps' times. */
    uint8_t *probe = aligned(64 << 20);
    fill_random(probe, 64 << 20);
    double c0 = now_ms();
    volatile uint32_t sink = crc32c(probe, 64 << 20);
    double crc_gbps = (64 << 20) / ((now_ms() - c0) * 1e6);
    (void)sink;
    free(probe);

    write_extents(path, extents);

    int listener = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof addr;
    if (bind(listener, (struct sockaddr *)&addr, sizeof addr) || listen(listener, 1) ||
        getsockname(listener, (struct sockaddr *)&addr, &len))
        die("listen");
    pid_t child = fork();
    if (child < 0) die("fork");
    if (child == 0) {
        int sock = accept(listener, NULL, NULL);
        if (sock < 0) die("accept");
        tune(sock);
        srv.fd = open(path, O_RDONLY | O_DIRECT);
        if (srv.fd < 0) die("server open");
        srv.slots = 2 * readers;
        serve(sock);
        _exit(0);
    }
    close(listener);
    int sock = socket(AF_INET, SOCK_STREAM, 0);
    tune(sock);
    if (connect(sock, (struct sockaddr *)&addr, sizeof addr)) die("connect");
    int fd = open(path, O_RDONLY | O_DIRECT);
    if (fd < 0) die("client open");
    uint8_t *raw = aligned(extent_bytes), *dst = aligned(PREFIX * block_bytes);

    double *ms[3];
    for (int s = 0; s < 3; s++) ms[s] = calloc((size_t)rounds, sizeof(double));
    double cpu0 = cpu_ms(RUSAGE_SELF);
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < 3; i++) {
            int step = (r + i) % 3;
            int64_t extent = (int64_t)r * 3 + step;
            if (step == 0) {
                double t0 = now_ms();
                full_pread(fd, raw, extent_bytes, (off_t)(extent * (int64_t)extent_bytes));
                ms[0][r] = now_ms() - t0;
            } else {
                ms[step][r] = client_get(sock, dst, extent, step == 2);
            }
        }
    double client_cpu = cpu_ms(RUSAGE_SELF) - cpu0, server_cpu;
    struct request stop = {-1, 0, 0};
    full_write(sock, &stop, sizeof stop);
    if (recv(sock, &server_cpu, sizeof server_cpu, MSG_WAITALL) != sizeof server_cpu) die("server cpu");
    int status;
    waitpid(child, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status)) {
        fprintf(stderr, "server failed\n");
        return 2;
    }
    printf("{\"block\": %zu, \"rounds\": %d, \"pieces\": %zu, \"readers\": %d, \"crc_gbps\": %.2f, ", block_bytes,
           rounds, pieces, readers, crc_gbps);
    printf("\"client_cpu_ms_per_get\": %.4f, \"server_cpu_ms_per_get\": %.4f, ", client_cpu / (2.0 * rounds),
           server_cpu / (2.0 * rounds));
    print_list("raw_ms", ms[0], rounds, ", ");
    print_list("serial_ms", ms[1], rounds, ", ");
    print_list("piped_ms", ms[2], rounds, "}\n");
    return 0;
}
