// A request's own suffix trie for suffix decoding, in C++: the same trie, drafts and ties as the Python
// reference, specdec.drafters.suffix_tree.RequestIndex (SuffixTrie plus the context's active suffix nodes,
// and draft_from), which the tests compare it with (tests/kernels/test_suffix_index.py).
//
// Why: in Python, indexing one token walks up to max_depth nodes (20 with the defaults: suffix_max_match
// 16 + 4 drafts), ~4.5 us a token at depth 24 for a 200-token prompt and ~7 us at 32k tokens, and drafting
// from the trie ~3.5 us a step on text with repeats; here ~0.8-1.2 us (~2.8 us at 32k tokens, where the
// edge table outgrows the caches), ~0.4 us, and ~125 bytes a node instead of ~270 (figures in
// docs/suffix_decoding.md; tests/kernels/test_suffix_index.py checks the two give the same tries and drafts).
//
// Nodes are integer ids (the root is 0): count (occurrences of the node's string, truncated at max_depth),
// seq (where the latest occurrence ends: larger is more recent, the tie-break), and the children in
// insertion order (the order the reference's dicts iterate in, which breaks exact ties in the draft
// heap). The trie only grows: a request's trie is dropped whole when the request ends.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

// The trie's edges, (node, token) -> child: open addressing with linear probing over one array of keys
// and one of values (a power-of-two capacity, at most half full). A lookup touches one or two cache lines
// where std::unordered_map touched a bucket, a heap node and its allocator's lists: indexing runs right
// after a forward has streamed the weights through the caches, so misses are what it costs.
class EdgeMap {
 public:
  static constexpr uint64_t kEmpty = ~uint64_t(0);  // no key: nodes are below 2**31

  // The value slot of key k and whether it was just inserted (value -1 then: the caller sets it).
  std::pair<int32_t*, bool> find_or_insert(uint64_t k) {
    if (2 * (size_ + 1) > keys_.size()) grow();
    size_t i = slot(k);
    while (true) {
      if (keys_[i] == k) return {&vals_[i], false};
      if (keys_[i] == kEmpty) {
        keys_[i] = k;
        vals_[i] = -1;
        ++size_;
        return {&vals_[i], true};
      }
      i = (i + 1) & (keys_.size() - 1);
    }
  }

 private:
  size_t slot(uint64_t k) const {  // Fibonacci hashing: the top bits of k times 2**64 / golden ratio
    return static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  void grow() {
    std::vector<uint64_t> keys(keys_.empty() ? 1024 : 2 * keys_.size(), kEmpty);
    std::vector<int32_t> vals(keys.size(), -1);
    keys_.swap(keys);
    vals_.swap(vals);
    shift_ = 64 - __builtin_ctzll(keys_.size());
    size_ = 0;
    for (size_t j = 0; j < keys.size(); ++j)
      if (keys[j] != kEmpty) *find_or_insert(keys[j]).first = vals[j];
  }

  std::vector<uint64_t> keys_;
  std::vector<int32_t> vals_;
  size_t size_ = 0;
  int shift_ = 64;
};

class RequestSuffixIndex {
 public:
  explicit RequestSuffixIndex(int64_t max_depth) : max_depth_(max_depth) {
    TORCH_CHECK(max_depth >= 1, "max_depth must be >= 1, got ", max_depth);
    count_.push_back(0);
    seq_.push_back(-1);
    kids_.emplace_back();
    active_.push_back(0);
  }

  // Index tokens[0..] as positions start, start + 1, ... of the sequence (SuffixTrie.extend per token).
  void extend(const std::vector<int64_t>& tokens, int64_t start) {
    for (int64_t token : tokens)  // all checked first: a bad one changes nothing
      TORCH_CHECK(token >= 0 && token < (int64_t(1) << 32), "token id out of range: ", token);
    std::vector<int32_t> next;
    next.reserve(static_cast<size_t>(max_depth_));
    int64_t pos = start;
    for (int64_t token : tokens) {
      next.clear();
      next.push_back(0);
      for (int32_t node : active_) {
        int32_t child = child_or_new(node, token);
        count_[child] += 1;
        seq_[child] = pos;
        if (static_cast<int64_t>(next.size()) < max_depth_) next.push_back(child);
      }
      active_.swap(next);
      ++pos;
    }
    num_indexed_ = std::max(num_indexed_, pos);
  }

  // The best draft from the request's own text: for each suffix of the context (1 .. max_match tokens,
  // shortest first, stopping at the first with no continuation) the draft below its node with a budget
  // of min(cap, ceil(spec_factor * length)); the highest score wins, ties the longer match. None, or
  // (token_ids, parents or None, score, match_length).
  pybind11::object best_draft(int64_t max_match, int64_t max_drafts, int64_t cap, double spec_factor,
                              double min_prob, bool tree) const {
    Draft best;
    bool have = false;
    int64_t longest = std::min<int64_t>(max_match, static_cast<int64_t>(active_.size()) - 1);
    for (int64_t length = 1; length <= longest; ++length) {
      int32_t node = active_[static_cast<size_t>(length)];
      if (kids_[node].empty()) break;
      double wanted = std::ceil(spec_factor * static_cast<double>(length));  // min() in double: no overflow
      int64_t budget = wanted >= static_cast<double>(cap) ? cap : static_cast<int64_t>(wanted);
      Draft d = draft_from(node, max_drafts, budget, min_prob, tree, length);
      if (!d.tokens.empty() && (!have || d.score >= best.score)) {
        best = std::move(d);
        have = true;
      }
    }
    if (!have) return pybind11::none();
    pybind11::object parents = pybind11::none();
    if (tree) parents = pybind11::cast(best.parents);
    return pybind11::make_tuple(pybind11::cast(best.tokens), parents, best.score, best.match_length);
  }

  int64_t num_nodes() const { return num_nodes_; }
  int64_t num_indexed() const { return num_indexed_; }
  int64_t max_depth() const { return max_depth_; }

  // The trie as nested {token: (count, children)} (SuffixTrie.to_dict, for the tests).
  pybind11::dict to_dict() const { return walk(0); }

 private:
  struct Draft {
    std::vector<int64_t> tokens;
    std::vector<int64_t> parents;
    double score = 0.0;
    int64_t match_length = 0;
  };

  // A heap entry, ordered as the reference's tuples (-path probability, -recency, push order).
  struct Entry {
    double neg_prob;
    int64_t neg_seq;
    int64_t order;
    int64_t token;
    int64_t parent;
    int64_t depth;
    int32_t node;
  };
  static bool later(const Entry& a, const Entry& b) {  // std heaps are max-heaps: invert for a min-heap
    if (a.neg_prob != b.neg_prob) return a.neg_prob > b.neg_prob;
    if (a.neg_seq != b.neg_seq) return a.neg_seq > b.neg_seq;
    return a.order > b.order;
  }

  static uint64_t key(int32_t node, int64_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(node)) << 32) | static_cast<uint64_t>(token);
  }

  int32_t child_or_new(int32_t node, int64_t token) {
    auto [value, inserted] = edges_.find_or_insert(key(node, token));
    if (!inserted) return *value;
    int32_t child = static_cast<int32_t>(count_.size());
    *value = child;
    count_.push_back(0);
    seq_.push_back(-1);
    kids_.emplace_back();
    kids_[node].emplace_back(token, child);
    ++num_nodes_;
    return child;
  }

  // specdec.drafters.suffix_tree.draft_from on this trie, operation for operation.
  Draft draft_from(int32_t node, int64_t max_depth, int64_t budget, double min_prob, bool tree,
                   int64_t match_length) const {
    Draft out;
    out.match_length = match_length;
    int64_t limit = tree ? budget : std::min(max_depth, budget);
    int64_t order = 0;
    std::vector<Entry> heap;
    auto push = [&](int32_t below, double prob, int64_t parent, int64_t depth) {
      const auto& children = kids_[below];
      if (children.empty() || depth > max_depth) return;
      int64_t total = 0;
      for (const auto& [token, child] : children) total += count_[child];
      auto consider = [&](int64_t token, int32_t child) {
        double p = prob * static_cast<double>(count_[child]) / static_cast<double>(total);
        if (p >= min_prob && p > 0) {
          heap.push_back(Entry{-p, -seq_[child], order++, token, parent, depth, child});
          std::push_heap(heap.begin(), heap.end(), later);
        }
      };
      if (tree) {
        for (const auto& [token, child] : children) consider(token, child);
      } else {  // the most frequent child (ties: the most recent; then the first, as Python's max)
        const std::pair<int64_t, int32_t>* top = &children.front();
        for (const auto& item : children) {
          const auto a = std::make_pair(count_[item.second], seq_[item.second]);
          const auto b = std::make_pair(count_[top->second], seq_[top->second]);
          if (a > b) top = &item;
        }
        consider(top->first, top->second);
      }
    };
    if (limit > 0) push(node, 1.0, -1, 1);
    while (!heap.empty() && static_cast<int64_t>(out.tokens.size()) < limit) {
      std::pop_heap(heap.begin(), heap.end(), later);
      Entry e = heap.back();
      heap.pop_back();
      out.tokens.push_back(e.token);
      if (tree) out.parents.push_back(e.parent);
      out.score -= e.neg_prob;
      push(e.node, -e.neg_prob, static_cast<int64_t>(out.tokens.size()) - 1, e.depth + 1);
    }
    return out;
  }

  pybind11::dict walk(int32_t node) const {
    std::vector<std::pair<int64_t, int32_t>> sorted(kids_[node].begin(), kids_[node].end());
    std::sort(sorted.begin(), sorted.end());
    pybind11::dict out;
    for (const auto& [token, child] : sorted)
      out[pybind11::int_(token)] = pybind11::make_tuple(count_[child], walk(child));
    return out;
  }

  int64_t max_depth_;
  std::vector<int64_t> count_;
  std::vector<int64_t> seq_;
  std::vector<std::vector<std::pair<int64_t, int32_t>>> kids_;
  EdgeMap edges_;
  std::vector<int32_t> active_;  // active_[i]: the node of the sequence's suffix of length i
  int64_t num_nodes_ = 0;
  int64_t num_indexed_ = 0;
};

}  // namespace

void bind_suffix_index(pybind11::module& m) {
  pybind11::class_<RequestSuffixIndex>(m, "RequestSuffixIndex",
                                       "a request's own suffix trie (kernels/csrc/suffix_index.cpp)")
      .def(pybind11::init<int64_t>(), pybind11::arg("max_depth"))
      .def("extend", &RequestSuffixIndex::extend, pybind11::arg("tokens"), pybind11::arg("start"))
      .def("best_draft", &RequestSuffixIndex::best_draft, pybind11::arg("max_match"),
           pybind11::arg("max_drafts"), pybind11::arg("cap"), pybind11::arg("spec_factor"),
           pybind11::arg("min_prob"), pybind11::arg("tree"))
      .def_property_readonly("num_nodes", &RequestSuffixIndex::num_nodes)
      .def_property_readonly("num_indexed", &RequestSuffixIndex::num_indexed)
      .def_property_readonly("max_depth", &RequestSuffixIndex::max_depth)
      .def("to_dict", &RequestSuffixIndex::to_dict);
}
