#include "nnet3/nnet-test-utils.h"
#include "nnet3/nnet-component-itf.h"
#include "oracle_io.h"
#include <fstream>
#include <cstdio>
using namespace kaldi;
using namespace kaldi::nnet3;
int main(int argc, char **argv) {
  int seed = atoi(argv[1]); std::string dir = argv[2];
  srand(seed);
  SetVerboseLevel(-1);
  Component *c = GenerateRandomSimpleComponent();
  { std::ofstream f((dir + "/type").c_str()); f << c->Type() << "\n"; }
  { std::ofstream f((dir + "/component.txt").c_str()); c->Write(f, false); }
  int32 rows = RandInt(1, 20);
  int32 props = c->Properties();
  CuMatrix<BaseFloat> in(rows, c->InputDim(), kSetZero, kStrideEqualNumCols), out(rows, c->OutputDim(), kSetZero, kStrideEqualNumCols);
  in.SetRandn();
  void *memo = c->Propagate(NULL, in, &out);
  CuMatrix<BaseFloat> od(rows, c->OutputDim(), kSetZero, kStrideEqualNumCols), id(rows, c->InputDim(), kSetZero, kStrideEqualNumCols);
  od.SetRandn();
  Component *g = NULL;
  if (props & kUpdatableComponent) {
    g = c->Copy();
    UpdatableComponent *u = dynamic_cast<UpdatableComponent*>(g);
    if (u) u->SetAsGradient();
  }
  c->Backprop("test", NULL, in, out, od, memo, g, &id);
  if (memo) c->DeleteMemo(memo);
  std::ofstream af((dir + "/arrays.txt").c_str());
  WriteMat(af, "input", Matrix<BaseFloat>(in));
  WriteMat(af, "output", Matrix<BaseFloat>(out));
  WriteMat(af, "output_deriv", Matrix<BaseFloat>(od));
  WriteMat(af, "input_deriv", Matrix<BaseFloat>(id));
  if (g) { std::ofstream f((dir + "/gradient.txt").c_str()); g->Write(f, false); }
  return 0;
}
