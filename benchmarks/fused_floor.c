// What SCAFFOLD's control variates add to FedAvg's round on the benchmark's
// workload without any framework: both algorithms' client work hand-fused
// into few passes over the weights. Built and run by
// benchmarks/fused_floor.py, which writes the inputs and checks the results.
//
// Model: flatten(84x84x3) + Dense(64, relu) + Dense(1), sigmoid cross-entropy
// (the benchmark's CelebA-shaped task). Per client, K plain SGD steps on its
// K batches of B examples; FedAvg sums n_i (y_i - x), SCAFFOLD (Option II)
// also corrects each step by c - c_i, forms c_i+ = c_i - c + (x - y_i)/(K lr)
// and sums c_i+ - c_i. Each step reads the weights once: its update also
// forms the next step's first-layer products, and the last step's update
// forms the sums (and c_i+), so y_i is never written. Clients run on OpenMP
// threads, each with its own scratch weights and sums, added up at the end
// of the round. One implementation as lean as we could make it, not a proof
// that none is leaner.
//
// build: cc -O3 -march=native -fopenmp -DBATCH=B fused_floor.c -lm
// usage: fused_floor DIR N K B LR ROUNDS memory|file|mapped CHECK
//   DIR holds x.f32, c.f32, images.f32 (N x K x B x D), labels.f32 (N x K x
//   B), and the c_i: states.f32 (N of them) for `memory`, else one file each,
//   DIR/states/<i>. `file` reads a client's c_i from its file with pread and
//   writes c_i+ back in place with pwrite: no versions and no atomicity,
//   which a store that survives a kill needs.
//   `mapped` maps each file instead and works on its pages in place.
//   CHECK=1 runs one round of each and writes their sums and the new c_i to
//   DIR; otherwise it prints the median seconds of ROUNDS timed rounds each,
//   after one untimed round, alternating FedAvg and SCAFFOLD.
#include <fcntl.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#define D (84 * 84 * 3)
#define H 64
#ifndef BATCH
#error "build with -DBATCH=<examples a step>"
#endif
#define B BATCH  // A constant, so that the loops over a batch unroll.
#define P ((size_t)D * H + H + H + 1)

static int N, K, FILE_STATES, MAPPED;
static float LR;
static const char *DIR_;

static void die(const char *what) { perror(what); exit(1); }

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

static float *read_floats(const char *name, size_t count) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", DIR_, name);
  FILE *f = fopen(path, "rb");
  if (!f) die(path);
  float *v = malloc(4 * count);
  if (!v || fread(v, 4, count, f) != count) die(path);
  fclose(f);
  return v;
}

static void write_floats(const char *name, const float *v, size_t count) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", DIR_, name);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(v, 4, count, f) != count || fclose(f)) die(path);
}

// The rest of a batch's forward and backward pass at weights w, given its
// first layer's products z1 = X W1 (B x H): the hidden layer's gradient dh
// (B x H) and the gradients of the small tensors (b1, W2, b2).
static void head(const float *w, float z1[B][H], const float *y, float *dh,
                 float *small_grads) {
  for (int b = 0; b < B; b++)
    for (int j = 0; j < H; j++) z1[b][j] += w[(size_t)D * H + j];
  const float *W2 = w + (size_t)D * H + H;
  float b2 = w[(size_t)D * H + 2 * H], dz2[B];
  for (int b = 0; b < B; b++) {
    float z = b2;
    for (int j = 0; j < H; j++) z += (z1[b][j] > 0 ? z1[b][j] : 0) * W2[j];
    dz2[b] = (1.f / (1.f + expf(-z)) - y[b]) / B;
  }
  memset(small_grads, 0, sizeof(float) * (2 * H + 1));
  for (int b = 0; b < B; b++) {
    for (int j = 0; j < H; j++) {
      float h = z1[b][j] > 0 ? z1[b][j] : 0;
      float g = z1[b][j] > 0 ? dz2[b] * W2[j] : 0;
      dh[b * H + j] = g;
      small_grads[j] += g;               // b1
      small_grads[H + j] += h * dz2[b];  // W2
    }
    small_grads[2 * H] += dz2[b];        // b2
  }
}

// The first step's pass at x.
static void forward_backward(const float *w, const float *X, const float *y,
                             float *dh, float *small_grads) {
  float z1[B][H];
  memset(z1, 0, sizeof z1);
  for (size_t d = 0; d < D; d++) {
    const float *row = w + d * H;
    for (int b = 0; b < B; b++) {
      float xv = X[(size_t)b * D + d];
      for (int j = 0; j < H; j++) z1[b][j] += xv * row[j];
    }
  }
  head(w, z1, y, dh, small_grads);
}

#define INLINE static inline __attribute__((always_inline))

// Weight i after a step with gradient g (corrected by c - c_i for SCAFFOLD).
INLINE float stepped(const float *from, const float *c, const float *ci,
                     size_t i, float g, int scaffold) {
  return from[i] - LR * (scaffold ? g + (c[i] - ci[i]) : g);
}

// The last step's weight v: its share of the sums, and c_i+.
INLINE void finish(const float *x, const float *c, float *ci, size_t i,
                   float v, float n, float inv_k_lr, float *sum,
                   float *cv_sum, int scaffold) {
  sum[i] += n * (v - x[i]);
  if (scaffold) {
    float new_ci = ci[i] - c[i] + (x[i] - v) * inv_k_lr;
    cv_sum[i] += new_ci - ci[i];
    ci[i] = new_ci;
  }
}

// W1[r, j]'s gradient: sum_b X[b, r] dh[b, j].
INLINE float w1_gradient(const float *xv, const float *dh, int j) {
  float g = 0;
  for (int b = 0; b < B; b++) g += xv[b] * dh[b * H + j];
  return g;
}

// One client; `scaffold` a constant in each of its two copies (client()), so
// that the update loops have no branches and vectorize. Each step reads the
// weights once: its update of W1's row r also adds the row's products for
// the next step's forward pass, and the last step's update forms the sums
// (and c_i+) instead of writing the final weights.
INLINE void client_t(const float *x, const float *c, float *ci, float *w,
                     const float *X, const float *y, float *sum,
                     float *cv_sum, const int scaffold) {
  float dh[B * H], small_grads[2 * H + 1];
  float z1[B][H];
  const float n = (float)(B * K), inv_k_lr = 1.f / (K * LR);
  forward_backward(x, X, y, dh, small_grads);
  for (int k = 0; k < K; k++) {
    const float *from = k == 0 ? x : w;
    const float *Xk = X + (size_t)k * B * D;
    const float *Xn = Xk + (size_t)B * D;  // next step's batch
    const int last = k == K - 1;
    if (!last) memset(z1, 0, sizeof z1);
    for (size_t r = 0; r < D; r++) {
      size_t lo = r * H;
      float xv[B], xn[B];
      for (int b = 0; b < B; b++) xv[b] = Xk[(size_t)b * D + r];
      if (!last) {
        for (int b = 0; b < B; b++) xn[b] = Xn[(size_t)b * D + r];
#pragma omp simd
        for (int j = 0; j < H; j++) {
          float v = stepped(from, c, ci, lo + j, w1_gradient(xv, dh, j),
                            scaffold);
          w[lo + j] = v;
          for (int b = 0; b < B; b++) z1[b][j] += xn[b] * v;
        }
      } else {
#pragma omp simd
        for (int j = 0; j < H; j++)
          finish(x, c, ci, lo + j,
                 stepped(from, c, ci, lo + j, w1_gradient(xv, dh, j),
                         scaffold),
                 n, inv_k_lr, sum, cv_sum, scaffold);
      }
    }
    for (size_t i = (size_t)D * H; i < P; i++) {
      float v = stepped(from, c, ci, i, small_grads[i - (size_t)D * H],
                        scaffold);
      if (!last)
        w[i] = v;
      else
        finish(x, c, ci, i, v, n, inv_k_lr, sum, cv_sum, scaffold);
    }
    if (!last) head(w, z1, y + (k + 1) * B, dh, small_grads);
  }
}

// c == NULL: FedAvg. ci: its c_i, replaced by c_i+ in place.
static void client(const float *x, const float *c, float *ci, float *w,
                   const float *X, const float *y, float *sum, float *cv_sum) {
  if (c) client_t(x, c, ci, w, X, y, sum, cv_sum, 1);
  else client_t(x, c, ci, w, X, y, sum, cv_sum, 0);
}

static void state_path(char *path, size_t size, int i) {
  snprintf(path, size, "%s/states/%d", DIR_, i);
}

// SCAFFOLD's client with its c_i in a file: read, train, write back.
static void file_client(int i, const float *x, const float *c, float *buffer,
                        float *w, const float *X, const float *y, float *sum,
                        float *cv_sum) {
  char path[4096];
  state_path(path, sizeof path, i);
  int fd = open(path, O_RDWR);
  if (fd < 0) die(path);
  if (pread(fd, buffer, 4 * P, 0) != (ssize_t)(4 * P)) die(path);
  client(x, c, buffer, w, X, y, sum, cv_sum);
  if (pwrite(fd, buffer, 4 * P, 0) != (ssize_t)(4 * P)) die(path);
  close(fd);
}

// The same with c_i mapped into memory (MAP_SHARED): the client reads c_i and
// writes c_i+ in the page cache's pages themselves, with no copy.
static void mapped_client(int i, const float *x, const float *c, float *w,
                          const float *X, const float *y, float *sum,
                          float *cv_sum) {
  char path[4096];
  state_path(path, sizeof path, i);
  int fd = open(path, O_RDWR);
  if (fd < 0) die(path);
  float *ci = mmap(NULL, 4 * P, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_POPULATE, fd, 0);
  if (ci == MAP_FAILED) die(path);
  client(x, c, ci, w, X, y, sum, cv_sum);
  if (munmap(ci, 4 * P)) die(path);
  close(fd);
}

int main(int argc, char **argv) {
  if (argc != 9) {
    fprintf(stderr, "usage: %s DIR N K B LR ROUNDS memory|file|mapped CHECK\n",
            argv[0]);
    return 2;
  }
  prctl(PR_SET_PDEATHSIG, SIGTERM);  // Ends with the benchmark that runs it.
  DIR_ = argv[1];
  N = atoi(argv[2]);
  K = atoi(argv[3]);
  if (atoi(argv[4]) != B) {
    fprintf(stderr, "built for batches of %d, got %s\n", B, argv[4]);
    return 2;
  }
  LR = (float)atof(argv[5]);
  int rounds = atoi(argv[6]);
  MAPPED = strcmp(argv[7], "mapped") == 0;
  FILE_STATES = MAPPED || strcmp(argv[7], "file") == 0;
  if (!FILE_STATES && strcmp(argv[7], "memory") != 0) {
    fprintf(stderr, "unknown state mode %s\n", argv[7]);
    return 2;
  }
  int check = atoi(argv[8]);
  if (N < 1 || K < 1 || rounds < 1) {
    fprintf(stderr, "bad arguments\n");
    return 2;
  }
  const int T = omp_get_max_threads();
  float *x = read_floats("x.f32", P), *c = read_floats("c.f32", P);
  // In RAM only in memory mode: a file client has nowhere else to read from.
  float *states = FILE_STATES ? NULL : read_floats("states.f32", (size_t)N * P);
  float *images = read_floats("images.f32", (size_t)N * K * B * D);
  float *labels = read_floats("labels.f32", (size_t)N * K * B);
  float **w = malloc(sizeof(float *) * T), **sums = malloc(sizeof(float *) * T),
        **cv_sums = malloc(sizeof(float *) * T),
        **buffers = malloc(sizeof(float *) * T);
  for (int t = 0; t < T; t++) {
    w[t] = calloc(P, 4);
    sums[t] = calloc(P, 4);
    cv_sums[t] = calloc(P, 4);
    buffers[t] = calloc(P, 4);
    if (!w[t] || !sums[t] || !cv_sums[t] || !buffers[t]) die("calloc");
  }
  double seconds[2][1024];
  int timed = check ? 1 : (rounds < 1024 ? rounds : 1024);
  for (int r = 0; r < timed + (check ? 0 : 1); r++) {
    for (int scaffold = 0; scaffold < 2; scaffold++) {
      double started = now();
#pragma omp parallel
      {
        int t = omp_get_thread_num();
        memset(sums[t], 0, 4 * P);
        if (scaffold) memset(cv_sums[t], 0, 4 * P);
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < N; i++) {
          const float *X = images + (size_t)i * K * B * D;
          const float *y = labels + (size_t)i * K * B;
          if (scaffold && MAPPED)
            mapped_client(i, x, c, w[t], X, y, sums[t], cv_sums[t]);
          else if (scaffold && FILE_STATES)
            file_client(i, x, c, buffers[t], w[t], X, y, sums[t], cv_sums[t]);
          else
            client(x, scaffold ? c : NULL,
                   states ? states + (size_t)i * P : NULL, w[t], X, y,
                   sums[t], cv_sums[t]);
        }
      }
      for (int t = 1; t < T; t++)
        for (size_t i = 0; i < P; i++) {
          sums[0][i] += sums[t][i];
          if (scaffold) cv_sums[0][i] += cv_sums[t][i];
        }
      double elapsed = now() - started;
      if (check) {
        write_floats(scaffold ? "scaffold_sum.f32" : "fedavg_sum.f32",
                     sums[0], P);
        if (scaffold) write_floats("scaffold_cv_sum.f32", cv_sums[0], P);
      } else if (r > 0) {
        seconds[scaffold][r - 1] = elapsed;
      }
    }
  }
  if (check) {
    if (FILE_STATES) {
      states = malloc(4 * (size_t)N * P);
      if (!states) die("malloc");
      char path[4096];
      for (int i = 0; i < N; i++) {
        state_path(path, sizeof path, i);
        FILE *f = fopen(path, "rb");
        if (!f || fread(states + (size_t)i * P, 4, P, f) != P) die(path);
        fclose(f);
      }
    }
    write_floats("states_after.f32", states, (size_t)N * P);
    return 0;
  }
  for (int a = 0; a < 2; a++)  // Medians.
    for (int i = 0; i < timed; i++)
      for (int j = i + 1; j < timed; j++)
        if (seconds[a][j] < seconds[a][i]) {
          double s = seconds[a][i];
          seconds[a][i] = seconds[a][j];
          seconds[a][j] = s;
        }
  printf("%d %.6f %.6f\n", T, seconds[0][timed / 2], seconds[1][timed / 2]);
  return 0;
}
