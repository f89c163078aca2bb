// Text matrices as the Python side reads them (oracle_io.py): "name rows cols", then rows.
#ifndef NNETC_KALDI_ORACLE_IO_H_
#define NNETC_KALDI_ORACLE_IO_H_
#include "matrix/kaldi-matrix.h"
#include <cstdio>
#include <ostream>
#include <string>

inline void WriteMat(std::ostream &os, const std::string &name,
                     const kaldi::MatrixBase<kaldi::BaseFloat> &m) {
  os << name << " " << m.NumRows() << " " << m.NumCols() << "\n";
  char buf[64];
  for (int r = 0; r < m.NumRows(); r++) {
    for (int c = 0; c < m.NumCols(); c++) { snprintf(buf, 64, "%.9g ", m(r, c)); os << buf; }
    os << "\n";
  }
}
#endif
