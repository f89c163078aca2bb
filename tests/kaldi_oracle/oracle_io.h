// What the drivers write for the Python side (oracle_io.py): text matrices ("name rows
// cols", then rows), the stats.json figures of a computation, request.json.
#ifndef NNETC_KALDI_ORACLE_IO_H_
#define NNETC_KALDI_ORACLE_IO_H_
#include "matrix/kaldi-matrix.h"
#include "nnet3/nnet-computation.h"
#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

inline void WriteMat(std::ostream &os, const std::string &name,
                     const kaldi::MatrixBase<kaldi::BaseFloat> &m) {
  os << name << " " << m.NumRows() << " " << m.NumCols() << "\n";
  char buf[64];
  for (int r = 0; r < m.NumRows(); r++) {
    for (int c = 0; c < m.NumCols(); c++) { snprintf(buf, 64, "%.9g ", m(r, c)); os << buf; }
    os << "\n";
  }
}

namespace kaldi {
namespace nnet3 {

// Command count (no-ops left out) and peak float32 bytes allocated and not yet freed, as in
// stats.json.
inline void Stats(const NnetComputation &c, std::ostream &os) {
  int64 cmds = 0, cur = 0, peak = 0;
  for (size_t i = 0; i < c.commands.size(); i++) {
    const NnetComputation::Command &cmd = c.commands[i];
    if (cmd.command_type == kNoOperation || cmd.command_type == kNoOperationPermanent) continue;
    cmds++;
    if (cmd.command_type == kAllocMatrix || cmd.command_type == kDeallocMatrix) {
      int32 m = c.submatrices[cmd.arg1].matrix_index;
      int64 b = 4LL * c.matrices[m].num_rows * c.matrices[m].num_cols;
      cur += (cmd.command_type == kAllocMatrix ? b : -b);
      if (cur > peak) peak = cur;
    }
  }
  os << "{\"commands\": " << cmds << ", \"peak_bytes\": " << peak << "}";
}

inline void WriteIoList(std::ostream &os, const std::vector<IoSpecification> &list) {
  for (size_t i = 0; i < list.size(); i++) {
    const IoSpecification &s = list[i];
    os << (i ? ", " : "") << "{\"name\": \"" << s.name << "\", \"has_deriv\": " << (s.has_deriv ? "true" : "false") << ", \"indexes\": [";
    for (size_t j = 0; j < s.indexes.size(); j++)
      os << (j ? ", " : "") << "[" << s.indexes[j].n << ", " << s.indexes[j].t << ", " << s.indexes[j].x << "]";
    os << "]}";
  }
}

// A ComputationRequest as request.json.
inline void WriteRequest(std::ostream &os, const ComputationRequest &r) {
  os << "{\"inputs\": [";
  WriteIoList(os, r.inputs);
  os << "], \"outputs\": [";
  WriteIoList(os, r.outputs);
  os << "], \"need_model_derivative\": " << (r.need_model_derivative ? "true" : "false")
     << ", \"store_component_stats\": " << (r.store_component_stats ? "true" : "false") << "}";
}

}  // namespace nnet3
}  // namespace kaldi
#endif
