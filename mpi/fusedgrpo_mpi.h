/*
 * fusedgrpo over MPI: an optional component (libfusedgrpo_mpi). The core
 * library never links MPI; this one gives its communicator hook
 * (fg_communicator) an MPI communicator, on a 2-D grid of ranks:
 *
 *               vocab rank 0    vocab rank 1   ...  (split the vocabulary: the hook)
 *   data row 0   rank 0          rank 1
 *   data row 1   rank V          rank V + 1         (split the batch: DDP-style mean)
 *
 * A row of vocab_shards ranks holds the same tokens and one slice of the
 * weight's rows each; the rows of the grid hold different sequences. World
 * rank r is vocab rank r % vocab_shards of data row r / vocab_shards.
 *
 * A step on every rank:
 *   fg_linear_grpo(ctx with fg_mpi_communicator(grid), ... this rank's weight
 *                  rows (vocab_start, vocab_total) and this row's sequences)
 *   fg_mpi_data_parallel_end(grid, status, out, ...)
 * The first is collective over the row (the library's entry agreement, flags
 * and exit agreement: every rank of the row returns the same status); the
 * second agrees on the status over the whole grid, then averages grad_weight,
 * grad_bias and the loss over the rows as DDP does. A rank given a bad token
 * id or NaN input therefore makes every rank return that status, and none
 * waits in a reduction.
 */
#ifndef FUSEDGRPO_MPI_H
#define FUSEDGRPO_MPI_H

#include <mpi.h>
#include <stdint.h>

#include "fusedgrpo.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fg_mpi_grid {
    MPI_Comm world;        /* the caller's communicator (not owned)                 */
    MPI_Comm vocab;        /* this rank's row: the ranks that split the vocabulary  */
    MPI_Comm data;         /* this rank's column: the ranks that split the batch    */
    int rank, size;
    int vocab_rank, vocab_shards;
    int data_rank, data_shards;
    /* What this rank has handed to MPI_Allreduce (payload, not wire bytes:
     * a ring allreduce sends about twice that), and how many calls. */
    int64_t hook_bytes, hook_calls;   /* the library's hook (over `vocab`)     */
    int64_t data_bytes, data_calls;   /* fg_mpi_data_parallel_end              */
} fg_mpi_grid;

/* Splits comm into rows of vocab_shards ranks. FG_ERR_INVALID_SIZE when
 * vocab_shards does not divide the size; FG_ERR_COMMUNICATOR when MPI fails.
 * Collective over comm. */
fg_status fg_mpi_grid_create(MPI_Comm comm, int vocab_shards, fg_mpi_grid *grid);
void fg_mpi_grid_free(fg_mpi_grid *grid);

/* The hook over grid->vocab (MPI_Allreduce on floats); counts into grid. */
fg_communicator fg_mpi_communicator(fg_mpi_grid *grid);

/* MPI_Allreduce in place of `count` floats over comm, in pieces below
 * MPI's int count. 0, or -1 when MPI fails. */
int fg_mpi_allreduce_floats(MPI_Comm comm, float *buf, int64_t count, MPI_Op op);

/* Part `index` of `parts` of [0, total): as even as can be (the first
 * total % parts parts one longer), so any total works. */
void fg_mpi_split(int64_t total, int parts, int index, int64_t *start, int64_t *count);

/* The data-parallel end of a step: the largest status of every rank of the
 * grid (a rank that failed makes all return its status; the others get a
 * message saying so in msg), then, if all succeeded, the mean over the data
 * rows of loss and of the float32 grad_weight and grad_bias (NULL: skipped),
 * in place. Collective over grid->world. */
fg_status fg_mpi_data_parallel_end(fg_mpi_grid *grid, fg_status local, double *loss,
                                   float *grad_weight, int64_t weight_floats, float *grad_bias,
                                   int64_t bias_floats, char *msg, size_t msg_len);

#ifdef __cplusplus
}
#endif
#endif
