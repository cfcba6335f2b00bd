/*
 * `gradcheck` and `bench` across MPI ranks: vocab_shards x data_shards ranks
 * under mpirun, each holding a slice of the weight's rows and of the batch's
 * sequences (mpi/fusedgrpo_mpi.h). Every rank makes the same whole problem
 * (same seed or --inputs), runs its part through the library's communicator
 * hook and the data-parallel end, and the whole outputs are assembled on
 * every rank, so gradcheck compares them with the single-process reference.
 *
 * The data rows are averaged as DDP does, which equals the whole batch's loss
 * when every row holds the same number of sequences (data_shards must divide
 * batch) and the normaliser is global: num_items_in_batch is set to the
 * global unmasked count / data_shards (TRL's convention). bnpo, the entropy
 * bonus and the entropy quantile normalise by a row's own tokens under DDP
 * (as in TRL), so they are refused with data_shards > 1.
 *
 * Built without MPI (no FT_HAVE_MPI), asking for shards is an error.
 */
#ifndef FT_SHARDED_H
#define FT_SHARDED_H

#include "runner.h"

typedef struct ft_shards ft_shards;

/* 1 when cfg asks for more than one rank. */
int ft_sharded_wanted(const ft_config *cfg);

/* MPI_Init and the grid; checks the rank count and the config. 0, or -1 with err. */
int ft_sharded_init(ft_shards **out, const ft_config *cfg, char *err, size_t errlen);

/* One step of r's impl (fused or baseline) as this rank's part: the
 * library call and the data-parallel end (what a training step does); with
 * `assemble`, then the whole outputs (loss, metrics, logp, entropy,
 * gradients) in r's buffers on every rank. Every rank returns the same
 * result: 0, or -1 with r->err (a rank that failed makes every rank fail,
 * within the step). */
int ft_sharded_step(ft_shards *s, ft_runner *r, int assemble);

/* `fusedgrpo bench` under mpirun (bench_sharded.c): each impl in this
 * process (no fork under MPI), step times as the slowest rank's, payload
 * bytes per rank and step; rank 0 prints and writes the JSON lines. */
int ft_bench_sharded(const ft_config *cfg, const char *inputs, const int *impls, int nimpl,
                     const char *json);

int ft_sharded_rank(const ft_shards *s);
/* Payload bytes this rank handed to MPI per step (hook, data end) and the
 * reductions, averaged over the steps run so far. */
void ft_sharded_traffic(const ft_shards *s, double *hook_bytes, double *data_bytes,
                        double *reductions);
/* The largest of every rank's x (a step time): collective. */
double ft_sharded_max(const ft_shards *s, double x);

/* MPI_Finalize. */
void ft_sharded_finish(ft_shards *s);

#endif
