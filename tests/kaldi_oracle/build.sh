#!/bin/sh
# Build the three Kaldi drivers of this folder against a Kaldi source tree (not part of
# this repository): the nnet3 library and what it needs, CPU only, OpenBLAS.
#   tests/kaldi_oracle/build.sh KALDI_SRC OUT_DIR
# KALDI_SRC: kaldi-asr/kaldi's src/ at the reference commit f40076610.  Needs g++ and
# Debian's libopenblas-dev liblapacke-dev libfst-dev (apt-get install -y ...).
# Objects are built inside KALDI_SRC (a scratch copy: two of its files are touched).
set -e
SRC=$(cd "$1" && pwd); OUT=$(mkdir -p "$2" && cd "$2" && pwd); HERE=$(cd "$(dirname "$0")" && pwd)
cd "$SRC"
[ -f base/version.h ] || printf '#define KALDI_VERSION "oracle"\n#define KALDI_GIT_HEAD "f40076610"\n' > base/version.h
# LAPACK >= 3.9.1 headers declare the hidden Fortran string lengths; pass them
sed -i -e 's/num_rows, Mdata, result);$/num_rows, Mdata, result, 1, 1);/' \
       -e 's/ipiv, work, result);$/ipiv, work, result, 1);/' \
       -e 's/Mdata, ipiv, result);$/Mdata, ipiv, result, 1);/' \
       -e 's/p_work, l_work, result); $/p_work, l_work, result, 1, 1);/' matrix/cblas-wrappers.h
FLAGS="-std=c++17 -O1 -w -I. -I/usr/include/x86_64-linux-gnu/openblas-pthread -DKALDI_DOUBLEPRECISION=0 -DHAVE_EXECINFO_H=1 -DHAVE_CXXABI_H -DHAVE_OPENBLAS -pthread"
NNET="nnet-common nnet-compile nnet-component-itf nnet-simple-component nnet-combined-component
  nnet-normalize-component nnet-general-component nnet-parse natural-gradient-online nnet-descriptor
  nnet-optimize nnet-computation nnet-computation-graph nnet-graph nnet-nnet nnet-compile-utils
  nnet-utils nnet-compute nnet-test-utils nnet-analyze nnet-optimize-utils convolution
  nnet-convolutional-component attention nnet-attention-component nnet-tdnn-component nnet-example
  nnet-compile-looped nnet-example-utils am-nnet-simple nnet-diagnostics nnet-training
  nnet-am-decodable-simple decodable-simple-looped nnet-batch-compute"
SRCS=$(ls base/*.cc matrix/*.cc util/*.cc cudamatrix/*.cc hmm/*.cc tree/*.cc | grep -v -- '-test.cc$')
for n in $NNET; do SRCS="$SRCS nnet3/$n.cc"; done
OBJS=""
for s in $SRCS; do OBJS="$OBJS ${s%.cc}.o"; done
for s in $SRCS; do
  o=${s%.cc}.o
  [ -f "$o" ] && [ "$o" -nt "$s" ] || echo "g++ $FLAGS -c $s -o $o"
done | xargs -P "$(nproc)" -I{} sh -c {}
rm -f libnnet3oracle.a && ar rcs libnnet3oracle.a $OBJS
for d in gen gencomp geninfer genchunk; do
  g++ $FLAGS "$HERE/$d.cc" libnnet3oracle.a -o "$OUT/$d" -lopenblas -llapacke -llapack -lfst -ldl
done
echo "built $OUT/gen $OUT/gencomp $OUT/geninfer $OUT/genchunk"
