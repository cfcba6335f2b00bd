/*
 * An in-process communicator for tests: S vocab shards as S threads, each
 * with its own context, reducing through shared buffers and a barrier
 * (fg_communicator). Every rank reduces all ranks' buffers in rank order, so
 * all get identical bits. A call whose count differs between the ranks
 * fails (returns nonzero) on every rank, as a mismatched MPI call would err.
 */
#ifndef FG_TEST_FAKE_COMM_H
#define FG_TEST_FAKE_COMM_H

#include "fusedgrpo.h"

typedef struct fake_comm fake_comm;

fake_comm *fake_comm_create(int shards);
void fake_comm_destroy(fake_comm *c);
/* Rank r's communicator (valid while c lives). */
fg_communicator fake_comm_rank(fake_comm *c, int rank);
/* Reductions made so far by rank 0. */
long fake_comm_calls(const fake_comm *c);

#endif
