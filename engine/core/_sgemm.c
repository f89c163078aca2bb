/* engine.core._sgemm: the float32 product out = x @ W^T for weights packed once
 * (engine/core/sgemm.py says when and why it is used).
 *
 * Every output element is one chain of fused multiply-adds over k = 0 .. K-1 in
 * order, starting from zero: acc = fma(x[i,k], w[j,k], acc).  Its value therefore
 * depends only on the row of x and the row of W, never on the shape of the product,
 * the position of the row, the instruction set (AVX-512 and AVX2 kernels compute the
 * same chain) or the number of threads.  An optional epilogue adds a bias row
 * (acc + b[j]) or the output's old value (out + acc), each one more rounding, as the
 * separate NumPy addition it replaces.
 *
 * W (N x K) is packed into panels of 32 rows of W: panel q holds, for each k, the 32
 * values w[32q .. 32q+31, k] side by side (zeros past N), so that the kernel reads
 * two (AVX-512) or four (AVX2) vectors of W per k and broadcasts one value of x per
 * row.  x may come as segments (a TDNN's time offsets: views of one input from other
 * rows), multiplied as one product over them side by side.  A product is split between
 * threads by rows where it has more rows than outputs, else by panels; the workers are
 * threads of this module that wait for work by spinning for a while, then sleep.
 *
 * CPython C API only (the buffer protocol for the arrays); the GIL is released while
 * the kernel runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define PANEL 32
#define MAX_THREADS 64

/* x: `nseg` segments of `d` columns each (K = nseg * d), segment s's row i at
   segs[s] + i * lda: a plain product has one segment; a TDNN's offsets are several, each
   a view of the same input from another row, multiplied as one product over them side
   by side (one chain over all nseg * d columns) without copying them side by side */
typedef void (*kernel_fn)(const float *const *segs, int nseg, int d, long lda, int m,
                          const float *p, int n, float *out, long ldc, const float *bias,
                          int accumulate, int relu, int q0, int q1);

#define MAX_SEGS 32

static kernel_fn g_kernel = NULL;   /* NULL: no kernel for this CPU */
static const char *g_isa = "none";

/* ------------------------------------------------------------------------------ */
/* AVX-512: 8 rows x 32 columns (16 accumulators) per step */

#define MR512 8

static inline __attribute__((always_inline, target("avx512f"))) void
micro512(const int mr, const float *const *segs, int nseg, int d, long row0, long lda,
         const float *b, float *c, long ldc, __mmask16 m0, __mmask16 m1, const float *bias,
         int accumulate, int relu)
{
    __m512 acc[MR512][2];
    for (int i = 0; i < mr; i++) {
        acc[i][0] = _mm512_setzero_ps();
        acc[i][1] = _mm512_setzero_ps();
    }
    for (int s = 0; s < nseg; s++) {
        const float *a = segs[s] + row0 * lda;
        for (int kk = 0; kk < d; kk++, b += PANEL) {
            const __m512 b0 = _mm512_load_ps(b);
            const __m512 b1 = _mm512_load_ps(b + 16);
            for (int i = 0; i < mr; i++) {
                const __m512 av = _mm512_set1_ps(a[i * lda + kk]);
                acc[i][0] = _mm512_fmadd_ps(av, b0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(av, b1, acc[i][1]);
            }
        }
    }
    if (bias) {
        const __m512 e0 = _mm512_maskz_loadu_ps(m0, bias);
        const __m512 e1 = _mm512_maskz_loadu_ps(m1, bias + 16);
        for (int i = 0; i < mr; i++) {
            acc[i][0] = _mm512_add_ps(acc[i][0], e0);
            acc[i][1] = _mm512_add_ps(acc[i][1], e1);
        }
    } else if (accumulate) {
        for (int i = 0; i < mr; i++) {
            acc[i][0] = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, c + i * ldc), acc[i][0]);
            acc[i][1] = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, c + i * ldc + 16), acc[i][1]);
        }
    }
    if (relu) {
        /* max(0, v): v where v is a NaN (MAXPS returns its second operand then), as
           NumPy's maximum(v, 0) */
        const __m512 zero = _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) {
            acc[i][0] = _mm512_max_ps(zero, acc[i][0]);
            acc[i][1] = _mm512_max_ps(zero, acc[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm512_mask_storeu_ps(c + i * ldc, m0, acc[i][0]);
        _mm512_mask_storeu_ps(c + i * ldc + 16, m1, acc[i][1]);
    }
}

static __attribute__((target("avx512f"))) void
kernel512(const float *const *segs, int nseg, int d, long lda, int m, const float *p, int n,
          float *out, long ldc, const float *bias, int accumulate, int relu, int q0, int q1)
{
    const long k = (long)nseg * d;
    for (int q = q0; q < q1; q++) {
        const int rem = n - q * PANEL;
        const __mmask16 m0 = rem >= 16 ? 0xffff : (__mmask16)((1u << rem) - 1);
        const __mmask16 m1 = rem >= 32 ? 0xffff
                             : rem <= 16 ? 0 : (__mmask16)((1u << (rem - 16)) - 1);
        const float *b = p + (long)q * k * PANEL;
        const float *bq = bias ? bias + q * PANEL : NULL;
        float *cq = out + q * PANEL;
        int i = 0;
        for (; i + MR512 <= m; i += MR512)
            micro512(MR512, segs, nseg, d, i, lda, b, cq + i * ldc, ldc, m0, m1, bq, accumulate, relu);
        float *c = cq + i * ldc;
        switch (m - i) {
        case 1: micro512(1, segs, nseg, d, i, lda, b, c, ldc, m0, m1, bq, accumulate, relu); break;
        case 2: micro512(2, segs, nseg, d, i, lda, b, c, ldc, m0, m1, bq, accumulate, relu); break;
        case 3: micro512(3, segs, nseg, d, i, lda, b, c, ldc, m0, m1, bq, accumulate, relu); break;
        case 4: micro512(4, segs, nseg, d, i, lda, b, c, ldc, m0, m1, bq, accumulate, relu); break;
        case 5: micro512(5, segs, nseg, d, i, lda, b, c, ldc, m0, m1, bq, accumulate, relu); break;
        case 6: micro512(6, segs, nseg, d, i, lda, b, c, ldc, m0, m1, bq, accumulate, relu); break;
        case 7: micro512(7, segs, nseg, d, i, lda, b, c, ldc, m0, m1, bq, accumulate, relu); break;
        default: break;
        }
    }
}

/* ------------------------------------------------------------------------------ */
/* AVX2 + FMA: 6 rows x 16 columns (12 accumulators) per step, each panel in two halves */

#define MR256 6

static inline __attribute__((always_inline, target("avx2,fma"))) __m256i
lane_mask(int cols)     /* the first `cols` (0..8) of 8 lanes */
{
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), idx);
}

static inline __attribute__((always_inline, target("avx2,fma"))) void
micro256(const int mr, const float *const *segs, int nseg, int d, long row0, long lda,
         const float *b, float *c, long ldc, int cols, const float *bias, int accumulate,
         int relu)
{
    /* b: the half panel (16 of the panel's 32 columns, row stride PANEL); cols: valid
       columns of the 16 (1..16) */
    __m256 acc[MR256][2];
    for (int i = 0; i < mr; i++) {
        acc[i][0] = _mm256_setzero_ps();
        acc[i][1] = _mm256_setzero_ps();
    }
    for (int s = 0; s < nseg; s++) {
        const float *a = segs[s] + row0 * lda;
        for (int kk = 0; kk < d; kk++, b += PANEL) {
            const __m256 b0 = _mm256_load_ps(b);
            const __m256 b1 = _mm256_load_ps(b + 8);
            for (int i = 0; i < mr; i++) {
                const __m256 av = _mm256_broadcast_ss(a + i * lda + kk);
                acc[i][0] = _mm256_fmadd_ps(av, b0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(av, b1, acc[i][1]);
            }
        }
    }
    const __m256i m0 = lane_mask(cols >= 8 ? 8 : cols);
    const __m256i m1 = lane_mask(cols >= 16 ? 8 : cols <= 8 ? 0 : cols - 8);
    if (bias) {
        const __m256 e0 = _mm256_maskload_ps(bias, m0);
        const __m256 e1 = _mm256_maskload_ps(bias + 8, m1);
        for (int i = 0; i < mr; i++) {
            acc[i][0] = _mm256_add_ps(acc[i][0], e0);
            acc[i][1] = _mm256_add_ps(acc[i][1], e1);
        }
    } else if (accumulate) {
        for (int i = 0; i < mr; i++) {
            acc[i][0] = _mm256_add_ps(_mm256_maskload_ps(c + i * ldc, m0), acc[i][0]);
            acc[i][1] = _mm256_add_ps(_mm256_maskload_ps(c + i * ldc + 8, m1), acc[i][1]);
        }
    }
    if (relu) {
        const __m256 zero = _mm256_setzero_ps();    /* (as micro512's) */
        for (int i = 0; i < mr; i++) {
            acc[i][0] = _mm256_max_ps(zero, acc[i][0]);
            acc[i][1] = _mm256_max_ps(zero, acc[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_maskstore_ps(c + i * ldc, m0, acc[i][0]);
        _mm256_maskstore_ps(c + i * ldc + 8, m1, acc[i][1]);
    }
}

static __attribute__((target("avx2,fma"))) void
kernel256(const float *const *segs, int nseg, int d, long lda, int m, const float *p, int n,
          float *out, long ldc, const float *bias, int accumulate, int relu, int q0, int q1)
{
    const long k = (long)nseg * d;
    for (int q = q0; q < q1; q++) {
        for (int h = 0; h < 2; h++) {
            const int col = q * PANEL + h * 16;
            const int cols = n - col >= 16 ? 16 : n - col;
            if (cols <= 0)
                break;
            const float *b = p + (long)q * k * PANEL + h * 16;
            const float *bq = bias ? bias + col : NULL;
            float *cq = out + col;
            int i = 0;
            for (; i + MR256 <= m; i += MR256)
                micro256(MR256, segs, nseg, d, i, lda, b, cq + i * ldc, ldc, cols, bq,
                         accumulate, relu);
            float *c = cq + i * ldc;
            switch (m - i) {
            case 1: micro256(1, segs, nseg, d, i, lda, b, c, ldc, cols, bq, accumulate, relu); break;
            case 2: micro256(2, segs, nseg, d, i, lda, b, c, ldc, cols, bq, accumulate, relu); break;
            case 3: micro256(3, segs, nseg, d, i, lda, b, c, ldc, cols, bq, accumulate, relu); break;
            case 4: micro256(4, segs, nseg, d, i, lda, b, c, ldc, cols, bq, accumulate, relu); break;
            case 5: micro256(5, segs, nseg, d, i, lda, b, c, ldc, cols, bq, accumulate, relu); break;
            default: break;
            }
        }
    }
}

/* ------------------------------------------------------------------------------ */
/* the workers
 *
 * A product is cut into `parts` pieces (by panels, or by rows where there are fewer
 * panels than parts).  The pieces are claimed from one 64-bit word, the job's number
 * (high 32 bits), its part count (bits 16-31) and the next unclaimed part (low 16
 * bits), by an atomic increment: the calling thread claims pieces until none is left,
 * and so do the workers that are awake, so a worker that is slow to wake costs
 * nothing but its share of the speed-up.  The job's description is written before its
 * word is published and not rewritten until every claimed piece is done. */

typedef struct {
    const float *segs[MAX_SEGS];
    int nseg, d;
    long lda;
    int m, k;
    const float *p;
    int n;
    float *out;
    long ldc;
    const float *bias;
    int accumulate;
    int relu;
    int parts;
    int by_rows;        /* split rows (else panels) */
    kernel_fn kernel;
} job_t;

static job_t g_job;
static pthread_mutex_t g_pool_lock = PTHREAD_MUTEX_INITIALIZER;  /* one product at a time */
static pthread_mutex_t g_sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wake = PTHREAD_COND_INITIALIZER;
static atomic_ullong g_claim;           /* job number << 32 | parts << 16 | next part */
static atomic_int g_done;               /* pieces of the current job finished */
static atomic_int g_sleepers;
static unsigned long long g_jobs;       /* jobs published (under g_pool_lock) */
static int g_workers;                   /* started */
static int (*g_thread_source)(void);    /* the BLAS's thread count, or NULL */
static int g_threads = 1;               /* used without a source */
/* a worker spins this long before it sleeps: longer than the gaps between the products
   of a chunk and than a chunk's forward on one thread (ThreadChoice's trials alternate
   one and several threads: a worker asleep after a one-thread run, woken again through
   the kernel, costs the next product ~70 us on a KVM guest) */
static const long g_spin_ns = 3000000;

static void
run_part(const job_t *j, int part)
{
    if (j->by_rows) {
        /* rows in blocks of 8 */
        const int blocks = (j->m + 7) / 8;
        const int b0 = (int)((long)blocks * part / j->parts);
        const int b1 = (int)((long)blocks * (part + 1) / j->parts);
        const int r0 = b0 * 8, r1 = b1 * 8 < j->m ? b1 * 8 : j->m;
        if (r1 > r0) {
            const float *segs[MAX_SEGS];
            for (int s = 0; s < j->nseg; s++)
                segs[s] = j->segs[s] + r0 * j->lda;
            j->kernel(segs, j->nseg, j->d, j->lda, r1 - r0, j->p, j->n, j->out + r0 * j->ldc,
                      j->ldc, j->bias, j->accumulate, j->relu, 0, (j->n + PANEL - 1) / PANEL);
        }
    } else {
        const int panels = (j->n + PANEL - 1) / PANEL;
        const int q0 = (int)((long)panels * part / j->parts);
        const int q1 = (int)((long)panels * (part + 1) / j->parts);
        if (q1 > q0)
            j->kernel(j->segs, j->nseg, j->d, j->lda, j->m, j->p, j->n, j->out, j->ldc, j->bias,
                      j->accumulate, j->relu, q0, q1);
    }
}

/* claims and runs pieces of the job whose word was `word` until none is left */
static void
work_on(void)
{
    for (;;) {
        const unsigned long long w = atomic_fetch_add(&g_claim, 1);
        const int parts = (int)((w >> 16) & 0xffff);
        const int part = (int)(w & 0xffff);
        if (part >= parts)
            return;
        run_part(&g_job, part);
        atomic_fetch_add_explicit(&g_done, 1, memory_order_release);
    }
}

static long
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static unsigned long long
job_of(unsigned long long word)
{
    return word >> 32;
}

static void *
worker_main(void *arg)
{
    unsigned long long seen = (unsigned long long)(uintptr_t)arg;   /* job number at start */
    for (;;) {
        unsigned long long job = job_of(atomic_load_explicit(&g_claim, memory_order_acquire));
        if (job == seen) {
            const long until = now_ns() + g_spin_ns;
            int spins = 0;
            while ((job = job_of(atomic_load_explicit(&g_claim, memory_order_acquire))) == seen) {
                _mm_pause();
                /* (no sched_yield here: on a KVM guest it delays the worker's notice of
                   the next job by microseconds, and the caller then does its share) */
                if (++spins == 64) {
                    spins = 0;
                    if (now_ns() > until)
                        break;
                }
            }
            if (job == seen) {
                pthread_mutex_lock(&g_sleep_lock);
                atomic_fetch_add(&g_sleepers, 1);
                while ((job = job_of(atomic_load(&g_claim))) == seen)
                    pthread_cond_wait(&g_wake, &g_sleep_lock);
                atomic_fetch_sub(&g_sleepers, 1);
                pthread_mutex_unlock(&g_sleep_lock);
            }
        }
        seen = job;
        work_on();
    }
    return NULL;
}

static void
after_fork_child(void)
{
    /* the workers do not exist in the child: start afresh */
    pthread_mutex_init(&g_pool_lock, NULL);
    pthread_mutex_init(&g_sleep_lock, NULL);
    pthread_cond_init(&g_wake, NULL);
    atomic_store(&g_sleepers, 0);
    g_workers = 0;
}

static int
ensure_workers(int wanted)      /* with g_pool_lock held; the workers there (>= 0) */
{
    while (g_workers < wanted) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 1 << 16);
        const int err = pthread_create(&t, &attr, worker_main, (void *)(uintptr_t)g_jobs);
        pthread_attr_destroy(&attr);
        if (err)
            break;
        g_workers++;
    }
    return g_workers;
}

static int
threads_now(void)
{
    int t = g_thread_source ? g_thread_source() : g_threads;
    return t < 1 ? 1 : t > MAX_THREADS ? MAX_THREADS : t;
}

/* products below this many multiply-adds per thread run on the calling thread alone */
static const long g_min_macs_per_thread = 1L << 16;

static void
product(job_t *j)
{
    const int panels = (j->n + PANEL - 1) / PANEL;
    const long macs = (long)j->m * j->n * j->k;
    const long most = macs / g_min_macs_per_thread;     /* pieces the work is worth */
    int threads = threads_now();
    if (most < threads)
        threads = (int)most;
    /* by rows, each thread reads its share of x and all of W; by panels, all of x and
       its share of W: the split that reads less (more rows than outputs: by rows) */
    const int by_rows = j->m >= 16 * threads && j->m > j->n;
    /* one piece a thread, claimed as they come (the caller takes a piece no worker has
       claimed by the time it is through its own); more pieces a thread made no
       difference on TDNN-F chunks (Intel Xeon model 167: 21x1, 150x1, 150x8 within the
       noise with 2 and 4) */
    const int units = by_rows ? (j->m + 7) / 8 : panels;
    long parts = threads;
    if (parts > units)
        parts = units;
    if (threads > parts)
        threads = (int)parts;
    if (threads <= 1 || pthread_mutex_trylock(&g_pool_lock) != 0) {
        /* one thread (or another thread's product holds the workers) */
        j->kernel(j->segs, j->nseg, j->d, j->lda, j->m, j->p, j->n, j->out, j->ldc, j->bias,
                  j->accumulate, j->relu, 0, panels);
        return;
    }
    if (ensure_workers(threads - 1) < 1) {
        pthread_mutex_unlock(&g_pool_lock);
        j->kernel(j->segs, j->nseg, j->d, j->lda, j->m, j->p, j->n, j->out, j->ldc, j->bias,
                  j->accumulate, j->relu, 0, panels);
        return;
    }
    j->parts = (int)parts;
    j->by_rows = by_rows;
    g_job = *j;
    atomic_store(&g_done, 0);
    g_jobs = (g_jobs + 1) & 0xffffffffULL;
    /* sequentially consistent: a worker going to sleep either sees it or is woken */
    atomic_store(&g_claim, (g_jobs << 32) | ((unsigned long long)parts << 16));
    if (atomic_load(&g_sleepers) > 0) {
        pthread_mutex_lock(&g_sleep_lock);
        pthread_cond_broadcast(&g_wake);
        pthread_mutex_unlock(&g_sleep_lock);
    }
    work_on();
    /* a piece still running on a worker: wait for it, giving the core away after a
       while (on a loaded machine the worker may be waiting for this one) */
    for (int spins = 0; atomic_load_explicit(&g_done, memory_order_acquire) < parts; spins++) {
        if (spins < 256)
            _mm_pause();
        else
            sched_yield();
    }
    pthread_mutex_unlock(&g_pool_lock);
}

/* ------------------------------------------------------------------------------ */
/* Python entry points */

static int
get_matrix(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES | PyBUF_FORMAT |
                           (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->ndim != 2 || view->itemsize != 4 || !view->format || strcmp(view->format, "f") != 0
        || (view->shape[0] && view->shape[1]
            && ((view->strides[1] != 4 && view->shape[1] > 1) || view->strides[0] % 4 != 0
                || view->strides[0] < 0))) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s: a 2-D float32 array with contiguous rows expected",
                     what);
        return -1;
    }
    return 0;
}

static int
get_vector(PyObject *obj, Py_buffer *view, Py_ssize_t len, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 4 || !view->format || strcmp(view->format, "f") != 0
        || view->len != len * 4) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s: a contiguous float32 array of %zd values expected",
                     what, len);
        return -1;
    }
    return 0;
}

static Py_ssize_t
packed_len(Py_ssize_t n, Py_ssize_t k)
{
    return ((n + PANEL - 1) / PANEL) * k * PANEL;
}

static PyObject *
py_pack(PyObject *self, PyObject *args)
{
    (void)self;
    /* pack(w, dst): dst (float32, 64-byte aligned, packed_len(N, K) values) <- W's panels */
    PyObject *wo, *po;
    if (!PyArg_ParseTuple(args, "OO", &wo, &po))
        return NULL;
    Py_buffer w, p;
    if (get_matrix(wo, &w, 0, "w") < 0)
        return NULL;
    if (PyObject_GetBuffer(po, &p, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&w);
        return NULL;
    }
    const Py_ssize_t n = w.shape[0], k = w.shape[1];
    const long ldw = w.strides[0] / 4;
    if (p.len != packed_len(n, k) * 4 || (p.len && ((uintptr_t)p.buf & 63) != 0)) {
        PyBuffer_Release(&w);
        PyBuffer_Release(&p);
        PyErr_SetString(PyExc_ValueError, "dst: a 64-byte aligned buffer of packed_len floats "
                        "expected");
        return NULL;
    }
    const float *src = w.buf;
    float *dst = p.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t q = 0; q * PANEL < n; q++) {
        float *panel = dst + q * k * PANEL;
        for (int j = 0; j < PANEL; j++) {
            const Py_ssize_t row = q * PANEL + j;
            if (row < n) {
                const float *wr = src + row * ldw;
                for (Py_ssize_t kk = 0; kk < k; kk++)
                    panel[kk * PANEL + j] = wr[kk];
            } else {
                for (Py_ssize_t kk = 0; kk < k; kk++)
                    panel[kk * PANEL + j] = 0.0f;
            }
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&w);
    PyBuffer_Release(&p);
    Py_RETURN_NONE;
}

static PyObject *
py_packed_len(PyObject *self, PyObject *args)
{
    (void)self;
    Py_ssize_t n, k;
    if (!PyArg_ParseTuple(args, "nn", &n, &k))
        return NULL;
    return PyLong_FromSsize_t(packed_len(n, k));
}

static int
overlap(const Py_buffer *a, const Py_buffer *b)
{
    const char *a0 = a->buf, *b0 = b->buf;
    const char *a1 = a0 + (a->shape[0] ? (a->shape[0] - 1) * a->strides[0] : 0) + a->shape[1] * 4;
    const char *b1 = b0 + (b->shape[0] ? (b->shape[0] - 1) * b->strides[0] : 0) + b->shape[1] * 4;
    return a0 < b1 && b0 < a1;
}

static PyObject *
py_nt(PyObject *self, PyObject *args)
{
    /* nt(x, packed, n, out, bias, accumulate, relu=False): out = x @ W^T (+ bias | + out),
       then max(0, .) with relu; x an array or a tuple of arrays of one shape and row
       stride (segments side by side); False, with nothing written, where out overlaps x */
    (void)self;
    PyObject *xo, *po, *oo, *bo;
    Py_ssize_t n;
    int accumulate, relu = 0;
    if (!PyArg_ParseTuple(args, "OOnOOp|p", &xo, &po, &n, &oo, &bo, &accumulate, &relu))
        return NULL;
    if (!g_kernel) {
        PyErr_SetString(PyExc_RuntimeError, "no product kernel for this CPU");
        return NULL;
    }
    const int is_tuple = PyTuple_Check(xo);
    const Py_ssize_t nseg = is_tuple ? PyTuple_GET_SIZE(xo) : 1;
    if (nseg < 1 || nseg > MAX_SEGS) {
        PyErr_Format(PyExc_ValueError, "x: 1 to %d segments expected", MAX_SEGS);
        return NULL;
    }
    Py_buffer xs[MAX_SEGS], p, o, b;
    int have_bias = bo != Py_None, got = 0, ok = 0, overlapping = 0;
    int have_p = 0, have_o = 0, have_b = 0;
    const char *bad = NULL;
    for (; got < nseg; got++) {
        if (get_matrix(is_tuple ? PyTuple_GET_ITEM(xo, got) : xo, &xs[got], 0, "x") < 0)
            goto done;
        if (got && (xs[got].shape[0] != xs[0].shape[0] || xs[got].shape[1] != xs[0].shape[1]
                    || (xs[0].shape[0] > 1 && xs[got].strides[0] != xs[0].strides[0]))) {
            got++;
            bad = "x: segments of one shape and row stride expected";
            break;
        }
    }
    if (!bad) {
        if (get_matrix(oo, &o, 1, "out") < 0)
            goto done;
        have_o = 1;
        if (PyObject_GetBuffer(po, &p, PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        have_p = 1;
        if (have_bias) {
            if (get_vector(bo, &b, n, "bias") < 0)
                goto done;
            have_b = 1;
        }
    }
    const Py_ssize_t m = xs[0].shape[0], d = xs[0].shape[1], k = nseg * d;
    if (bad)
        ;
    else if (o.shape[0] != m || o.shape[1] != n)
        bad = "out: shape (x rows, n) expected";
    else if (p.len != packed_len(n, k) * 4 || (p.len && ((uintptr_t)p.buf & 63) != 0))
        bad = "packed: the 64-byte aligned panels of an (n, x columns) weight expected";
    else if (have_bias && accumulate)
        bad = "a bias and accumulate cannot both be given";
    else if (m > INT_MAX || n > INT_MAX || k > INT_MAX)
        bad = "dimensions too large";
    if (bad) {
        PyErr_SetString(PyExc_ValueError, bad);
        goto done;
    }
    for (Py_ssize_t s = 0; s < nseg && m && n; s++)
        overlapping |= overlap(&xs[s], &o);
    if (m && n && !overlapping) {
        job_t j;
        memset(&j, 0, sizeof j);
        for (Py_ssize_t s = 0; s < nseg; s++)
            j.segs[s] = xs[s].buf;
        j.nseg = (int)nseg;
        j.d = (int)d;
        j.lda = xs[0].strides[0] / 4;
        j.m = (int)m;
        j.k = (int)k;
        j.p = p.buf;
        j.n = (int)n;
        j.out = o.buf;
        j.ldc = o.strides[0] / 4;
        j.bias = have_bias ? b.buf : NULL;
        j.accumulate = accumulate;
        j.relu = relu;
        j.parts = 1;
        j.kernel = g_kernel;
        Py_BEGIN_ALLOW_THREADS
        product(&j);
        Py_END_ALLOW_THREADS
    }
    ok = 1;
done:
    for (int s = 0; s < got; s++)
        PyBuffer_Release(&xs[s]);
    if (have_o)
        PyBuffer_Release(&o);
    if (have_p)
        PyBuffer_Release(&p);
    if (have_b)
        PyBuffer_Release(&b);
    if (!ok)
        return NULL;
    return PyBool_FromLong(!overlapping);
}

static PyObject *
py_set_threads(PyObject *self, PyObject *args)
{
    (void)self;
    /* set_threads(n, source=0): n threads, or (source != 0) as many as the C function
       int source(void) says at each product (a BLAS library's thread-count getter) */
    int n;
    unsigned long long source = 0;
    if (!PyArg_ParseTuple(args, "i|K", &n, &source))
        return NULL;
    if (n < 1 || n > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads: 1 to %d", MAX_THREADS);
        return NULL;
    }
    g_threads = n;
    g_thread_source = (int (*)(void))(uintptr_t)source;
    Py_RETURN_NONE;
}

static PyObject *
py_threads(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromLong(threads_now());
}

static PyObject *
py_isa(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(g_isa);
}

static PyObject *
py_use_isa(PyObject *self, PyObject *args)
{
    (void)self;
    /* use_isa(name): "avx512", "avx2" (if the CPU has it) or "none"; for tests */
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name))
        return NULL;
    __builtin_cpu_init();
    if (strcmp(name, "avx512") == 0 && __builtin_cpu_supports("avx512f")) {
        g_kernel = kernel512;
        g_isa = "avx512";
    } else if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2")
               && __builtin_cpu_supports("fma")) {
        g_kernel = kernel256;
        g_isa = "avx2";
    } else if (strcmp(name, "none") == 0) {
        g_kernel = NULL;
        g_isa = "none";
    } else {
        PyErr_Format(PyExc_ValueError, "this CPU has no %s", name);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"pack", py_pack, METH_VARARGS, "pack(w, dst): W's panels into dst"},
    {"packed_len", py_packed_len, METH_VARARGS, "packed_len(n, k): floats of W's panels"},
    {"nt", py_nt, METH_VARARGS,
     "nt(x, packed, n, out, bias, accumulate, relu=False): out = x @ W^T, + bias or + out, "
     "max(0, .) with relu; False where out overlaps x"},
    {"set_threads", py_set_threads, METH_VARARGS, "set_threads(n, source=0)"},
    {"threads", py_threads, METH_NOARGS, "the thread count of the next product"},
    {"isa", py_isa, METH_NOARGS, "the kernel in use: avx512, avx2 or none"},
    {"use_isa", py_use_isa, METH_VARARGS, "use_isa(name): choose the kernel (tests)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sgemm", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC
PyInit__sgemm(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        g_kernel = kernel512;
        g_isa = "avx512";
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        g_kernel = kernel256;
        g_isa = "avx2";
    }
    pthread_atfork(NULL, NULL, after_fork_child);
    PyObject *mod = PyModule_Create(&module);
    if (mod && PyModule_AddIntConstant(mod, "PANEL", PANEL) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
