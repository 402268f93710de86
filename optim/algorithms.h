// The registry's rows, one function per algorithm file (internal to optim/;
// optim/registry.h says how to add one).
#ifndef ONEBIT_OPTIM_ALGORITHMS_H_
#define ONEBIT_OPTIM_ALGORITHMS_H_

#include "optim/registry.h"

namespace onebit {

const AlgorithmRow& SgdRow();              // optim/sgd.cc
const AlgorithmRow& AdamRow();             // optim/adam.cc
const AlgorithmRow& OnebitAdamRow();       // optim/onebit_adam.cc
const AlgorithmRow& NaiveOnebitAdamRow();  // optim/naive_onebit_adam.cc
const AlgorithmRow& EfSgdRow();            // optim/ef_sgd.cc
const AlgorithmRow& ZeroOneAdamRow();      // optim/zero_one_adam.cc
const AlgorithmRow& OnebitLambRow();       // optim/onebit_lamb.cc
const AlgorithmRow& DilocoRow();           // optim/diloco.cc

}  // namespace onebit

#endif  // ONEBIT_OPTIM_ALGORITHMS_H_
