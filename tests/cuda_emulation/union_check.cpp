// slot_union's UNION_GROUP (union.inc, written by tests/test_slot_union_emulated.py) on emulated
// thread blocks, against a std::map per group; WINDOW (-D) is slot_union.WINDOW. Exit status: the
// number of failing shapes.
#include <cstdio>
#include <map>
#include <random>

#include "block.h"
#include "union.inc"

// `groups` groups of G tokens, each choosing distinct keys from its own range of `range` keys
// (shifted per group), all K, a third of K or none (every fifth token), in random slot order.
// The last group has only `last` tokens (a token count that G does not divide): the kernel is told
// so and must ignore the slots after them, which hold keys here.
template <int K, int G, int THREADS, int W>
bool check(int groups, int range, unsigned seed, int last = G) {
  constexpr int N = G * K;
  std::mt19937 rng(seed);
  std::vector<int> idx(groups * N), uni(groups * N, 7), vis(groups * N, 7), cnt(groups, 7);
  for (int r = 0; r < groups * G; ++r) {
    std::vector<int> pool(range);
    for (int i = 0; i < range; ++i) pool[i] = (r / G) * 37 + i;
    std::shuffle(pool.begin(), pool.end(), rng);
    const int used = r % 5 == 1 ? 0 : r % 3 == 0 ? K / 3 : K;
    for (int s = 0; s < K; ++s) idx[r * K + s] = s < used && s < range ? pool[s] : -1;
    std::shuffle(idx.begin() + r * K, idx.begin() + (r + 1) * K, rng);
  }
  auto slots = [&](int g) { return (g == groups - 1 ? last : G) * K; };
  for (int g = 0; g < groups; ++g)
    emu::run_block(THREADS, [&] {
      glm5_union_group<K, G, THREADS, W>(&idx[g * N], slots(g), &uni[g * N], &vis[g * N], &cnt[g]);
    });
  int wrong = 0, largest = 0;
  for (int g = 0; g < groups; ++g) {
    std::map<int, int> who;  // key → bits of the tokens that chose it, keys ascending
    for (int s = 0; s < slots(g); ++s)
      if (idx[g * N + s] >= 0) who[idx[g * N + s]] |= 1 << (s / K);
    bool ok = cnt[g] == static_cast<int>(who.size());
    int i = 0;
    for (auto [key, bits] : who) ok &= uni[g * N + i] == key && vis[g * N + i] == bits, ++i;
    for (; i < N; ++i) ok &= uni[g * N + i] == -1 && vis[g * N + i] == 0;
    wrong += !ok;
    largest = max(largest, cnt[g]);
  }
  std::printf("K=%d G=%d threads=%d window=%d key range=%d last group %d tokens: %d of %d groups wrong, largest union %d\n",
              K, G, THREADS, W, range, last, wrong, groups, largest);
  return wrong == 0;
}

int main() {
  int failed = 0;
  failed += !check<2048, 2, 256, WINDOW>(4, 3000, 1);
  failed += !check<2048, 4, 256, WINDOW>(4, 5000, 2);
  failed += !check<2048, 8, 512, WINDOW>(3, 50000, 3);  // keys over 7 windows
  failed += !check<2048, 4, 256, WINDOW>(3, 2048, 4);   // every key of the range chosen
  failed += !check<64, 4, 256, WINDOW>(6, 100, 5);      // the tiny model's padded top-k
  failed += !check<64, 8, 256, WINDOW>(6, 100, 8, 5);   // and its 4 heads padded to 8: groups of 8, the last short
  failed += !check<2048, 4, 256, WINDOW>(4, 5000, 6, 3);  // a short last group: 3 tokens of 4
  failed += !check<2048, 2, 256, WINDOW>(3, 3000, 7, 1);  // and 1 of 2
  return failed;
}
