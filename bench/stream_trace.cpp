// Summary of the stream kernel's per-warp timeline (`fp4moe bench --mode gemm --trace`). Host code only:
// kept out of the .cu files, whose nvcc host pass rejects fmt/format.h's constexpr paths.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gemm_bench.hpp"

namespace fp4moe::bench {

std::string summarize_stream_trace(const std::vector<unsigned long long>& v, int warps_per_cta,
                                   const std::string& title) {
  constexpr int S = kStreamTraceSlots;
  const size_t warps = v.size() / S;
  auto at = [&](size_t w, int s) { return v[w * S + s]; };
  // When a warp finished: its exit, or its entry if it returned before the loop (a CTA without work).
  auto done = [&](size_t w) { return std::max(at(w, kTraceExit), at(w, kTraceEntry)); };
  unsigned long long t0 = ~0ull, t1 = 0;
  size_t live = 0;
  for (size_t w = 0; w < warps; ++w)
    if (at(w, kTraceEntry) != 0) t0 = std::min(t0, at(w, kTraceEntry)), t1 = std::max(t1, done(w)), ++live;
  if (live == 0) return fmt::format("  trace {}: no warp wrote its timeline\n", title);
  auto us = [&](unsigned long long t) { return static_cast<double>(t - t0) * 1e-3; };
  std::string out = fmt::format("  trace {}: {} warps ran; first entry -> last exit {:.1f} us\n", title, live, us(t1));
  auto quantiles = [&](std::vector<double> x, const char* name) {
    if (x.empty()) return;
    std::sort(x.begin(), x.end());
    auto q = [&](double f) { return x[std::min(x.size() - 1, static_cast<size_t>(f * static_cast<double>(x.size() - 1) + 0.5))]; };
    out += fmt::format("    {:<38} {:7.1f} {:7.1f} {:7.1f} {:7.1f} {:7.1f}\n", name, x.front(), q(0.1), q(0.5), q(0.9),
                       x.back());
  };
  out += fmt::format("    {:<38} {:>7} {:>7} {:>7} {:>7} {:>7}\n", "event (us after the first entry)", "min", "p10", "p50",
                     "p90", "max");
  const char* names[] = {"entry", "griddepcontrol.wait returned", "schedule built (CTA barrier)",
                         "ring's first half requested", "first piece open (rows in)", "math loop done"};
  static_assert(kTraceEntry == 0 && kTraceExit == 5, "names[] follows the event slots");
  for (int s = kTraceEntry; s <= kTraceExit; ++s) {
    std::vector<double> x;
    for (size_t w = 0; w < warps; ++w)
      if (at(w, kTraceEntry) != 0 && at(w, s) != 0) x.push_back(us(at(w, s)));
    quantiles(x, names[s]);
  }
  // The CTAs' finishing spread (a CTA is done when its last warp is), also by the rounds a CTA ran (its
  // warps' largest count): a round change costs a barrier, a row load and the split m-tiles' sums, so
  // CTAs with more rounds finish later unless the split accounts for it.
  if (warps_per_cta > 0) {
    std::vector<double> x;
    // each CTA's SM (kTraceSmid, %smid + 1) and finishing time, to tell a per-SM rate from chance
    std::vector<std::pair<unsigned long long, double>> by_sm;
    double sum[4] = {0, 0, 0, 0};
    int n[4] = {0, 0, 0, 0};
    for (size_t c = 0; c * warps_per_cta < warps; ++c) {
      unsigned long long e = 0, rounds = 0, sm = 0;
      for (size_t w = c * warps_per_cta; w < std::min(warps, (c + 1) * warps_per_cta); ++w)
        if (at(w, kTraceEntry) != 0)
          e = std::max(e, done(w)), rounds = std::max(rounds, at(w, kTraceRounds)), sm = std::max(sm, at(w, kTraceSmid));
      if (e == 0) continue;
      x.push_back(us(e));
      if (sm != 0) by_sm.emplace_back(sm - 1, us(e));
      const int b = static_cast<int>(std::min<unsigned long long>(rounds, 3));
      sum[b] += us(e);
      ++n[b];
    }
    quantiles(x, "CTA done (its last warp)");
    std::sort(by_sm.begin(), by_sm.end());
    out += "    CTA done by SM (smid:us):";
    for (const auto& [sm, t] : by_sm) out += fmt::format(" {}:{:.1f}", sm, t);
    out += "\n";
    out += "    CTA done, mean by rounds run:";
    for (int b = 0; b < 4; ++b)
      if (n[b] > 0) out += fmt::format(" {}{} rounds: {:.1f} us ({} CTAs);", b, b == 3 ? "+" : "", sum[b] / n[b], n[b]);
    out += "\n";
  }
  // Which warps of a CTA wait at its round-end barriers (the others arrive last): the mean wait by the
  // warp's index in its CTA. A pattern by index (or by index mod 4, the SM sub-partition) would be a
  // static imbalance a split could undo; a flat one is the warps' random rates.
  if (warps_per_cta > 0) {
    std::vector<double> wsum(static_cast<size_t>(warps_per_cta), 0.0);
    std::vector<int> wn(static_cast<size_t>(warps_per_cta), 0);
    for (size_t w = 0; w < warps; ++w)
      if (at(w, kTraceEntry) != 0) {
        wsum[w % warps_per_cta] += static_cast<double>(at(w, kTraceRoundEndNs)) * 1e-3;
        ++wn[w % warps_per_cta];
      }
    out += "    round-end barrier wait by warp in CTA (mean us):";
    for (int i = 0; i < warps_per_cta; ++i)
      if (wn[i] > 0) out += fmt::format(" {}:{:.2f}", i, wsum[i] / wn[i]);
    out += "\n";
  }
  auto mean = [&](int s) {
    double m = 0;
    for (size_t w = 0; w < warps; ++w)
      if (at(w, kTraceEntry) != 0) m += static_cast<double>(at(w, s));
    return m / static_cast<double>(live);
  };
  out += fmt::format("    per warp (mean): {:.1f} K chunks, {:.2f} rounds; stream_advance {:.1f} calls, {:.2f} us "
                     "inside: round-end barrier {:.2f} us, activation rows {:.2f} us, m-tile stores {:.2f} us; "
                     "stream_cursor_next {:.1f} calls, {:.2f} us\n",
                     mean(kTraceChunks), mean(kTraceRounds), mean(kTraceAdvanceCalls), mean(kTraceAdvanceNs) * 1e-3,
                     mean(kTraceRoundEndNs) * 1e-3, mean(kTraceRowsInNs) * 1e-3, mean(kTraceEpilogueNs) * 1e-3,
                     mean(kTraceCursorCalls), mean(kTraceCursorNs) * 1e-3);
  return out;
}

}  // namespace fp4moe::bench
