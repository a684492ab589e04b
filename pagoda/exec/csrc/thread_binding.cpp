// Pins torch's intra-op (OpenMP) threads one to a CPU: the engine core's threads, where they share
// a machine's few cores with the API process and the load's client (pagoda/exec/cpu_threads.py says
// when).
//
// Why: a step of the engine runs a few hundred parallel regions, each ended by a barrier. Unbound,
// when another process takes a core from one of the threads, the scheduler may queue that thread
// behind its sibling on the other core; the two then take turns on one core (each spinning while
// the other computes) and the freed core stays idle 6-15 ms at a stretch (perf sched over a served batch
// on two cores, docs/perf-notes.md, 2026-12-07 evening). Bound, a displaced thread waits on its
// own core only.
//
// The binding is done inside one of torch's own parallel regions (at::parallel_for), so it reaches
// the threads torch's and oneDNN's regions run on: thread i of the team is the same pool thread in
// every region of the same size (libgomp keeps its pool), and thread 0 is the calling thread.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Runs fn(thread number) once on each of torch's threads, all at once; checks that each one ran.
template <typename F>
void on_each_thread(int64_t n, F fn) {
  std::vector<char> ran(n, 0);
  // One item a thread: with grain 1 and n items, ATen gives thread t exactly item t.
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    const int t = at::get_thread_num();
    TORCH_CHECK(t >= 0 && t < n && end - begin == 1, "thread_binding: thread ", t, " got items [", begin, ", ", end, ")");
    fn(t);
    ran[t] = 1;
  });
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(ran[t], "thread_binding: thread ", t, " of ", n, " did not run");
}

}  // namespace

// Binds thread i of torch's pool to cpus[i] (thread 0: the calling thread); returns each thread's
// kernel thread id, so that the binding can be checked in /proc.
std::vector<int64_t> bind_threads(const std::vector<int64_t>& cpus) {
  const int64_t n = at::get_num_threads();
  TORCH_CHECK(static_cast<int64_t>(cpus.size()) == n, "bind_threads: ", cpus.size(), " CPUs for ", n, " threads");
  for (int64_t cpu : cpus) TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "bind_threads: no CPU ", cpu);
  std::vector<int64_t> tids(n, -1);
  std::vector<int> errors(n, 0);
  on_each_thread(n, [&](int t) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[t]), &set);
    errors[t] = sched_setaffinity(0, sizeof(set), &set) == 0 ? 0 : errno;
    tids[t] = static_cast<int64_t>(syscall(SYS_gettid));
  });
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(errors[t] == 0, "bind_threads: thread ", t, " to CPU ", cpus[t], ": ", std::strerror(errors[t]));
  return tids;
}

// The CPU each of torch's threads runs on, by thread number: what a test of the binding reads.
std::vector<int64_t> thread_cpus() {
  const int64_t n = at::get_num_threads();
  std::vector<int64_t> cpus(n, -1);
  on_each_thread(n, [&](int t) { cpus[t] = sched_getcpu(); });
  return cpus;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bind_threads", &bind_threads);
  m.def("thread_cpus", &thread_cpus);
}
