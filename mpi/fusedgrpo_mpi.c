/* fusedgrpo over MPI (see fusedgrpo_mpi.h). */
#include <stdio.h>

#include "fusedgrpo_mpi.h"

fg_status fg_mpi_grid_create(MPI_Comm comm, int vocab_shards, fg_mpi_grid *g)
{
    *g = (fg_mpi_grid){0};
    g->world = comm;
    g->vocab = g->data = MPI_COMM_NULL;
    if (MPI_Comm_rank(comm, &g->rank) != MPI_SUCCESS || MPI_Comm_size(comm, &g->size) != MPI_SUCCESS)
        return FG_ERR_COMMUNICATOR;
    if (vocab_shards < 1 || g->size % vocab_shards != 0)
        return FG_ERR_INVALID_SIZE;
    g->vocab_shards = vocab_shards;
    g->data_shards = g->size / vocab_shards;
    g->vocab_rank = g->rank % vocab_shards;
    g->data_rank = g->rank / vocab_shards;
    if (MPI_Comm_split(comm, g->data_rank, g->vocab_rank, &g->vocab) != MPI_SUCCESS ||
        MPI_Comm_split(comm, g->vocab_rank, g->data_rank, &g->data) != MPI_SUCCESS) {
        fg_mpi_grid_free(g);
        return FG_ERR_COMMUNICATOR;
    }
    return FG_OK;
}

void fg_mpi_grid_free(fg_mpi_grid *g)
{
    if (g->vocab != MPI_COMM_NULL)
        MPI_Comm_free(&g->vocab);
    if (g->data != MPI_COMM_NULL)
        MPI_Comm_free(&g->data);
}

/* Counts are int in MPI: reduce in pieces below INT_MAX floats. */
int fg_mpi_allreduce_floats(MPI_Comm comm, float *buf, int64_t count, MPI_Op op)
{
    const int64_t piece = (int64_t)1 << 30;
    for (int64_t i = 0; i < count; i += piece) {
        const int n = (int)(count - i < piece ? count - i : piece);
        if (MPI_Allreduce(MPI_IN_PLACE, buf + i, n, MPI_FLOAT, op, comm) != MPI_SUCCESS)
            return -1;
    }
    return 0;
}

static int hook(void *user, float *buf, int64_t count, fg_reduce_op op)
{
    fg_mpi_grid *g = user;
    g->hook_calls++;
    g->hook_bytes += count * (int64_t)sizeof(float);
    return fg_mpi_allreduce_floats(g->vocab, buf, count, op == FG_REDUCE_MAX ? MPI_MAX : MPI_SUM);
}

fg_communicator fg_mpi_communicator(fg_mpi_grid *g)
{
    fg_communicator c = {hook, g};
    return c;
}

void fg_mpi_split(int64_t total, int parts, int index, int64_t *start, int64_t *count)
{
    const int64_t base = total / parts, extra = total % parts;
    *start = index * base + (index < extra ? index : extra);
    *count = base + (index < extra ? 1 : 0);
}

fg_status fg_mpi_data_parallel_end(fg_mpi_grid *g, fg_status local, double *loss,
                                   float *grad_weight, int64_t weight_floats, float *grad_bias,
                                   int64_t bias_floats, char *msg, size_t msg_len)
{
    int status = (int)local;
    g->data_calls++;
    g->data_bytes += (int64_t)sizeof status;
    if (MPI_Allreduce(MPI_IN_PLACE, &status, 1, MPI_INT, MPI_MAX, g->world) != MPI_SUCCESS)
        return FG_ERR_COMMUNICATOR;
    if (status != FG_OK) {
        if (local == FG_OK && msg && msg_len)
            snprintf(msg, msg_len, "%s: another rank of the grid failed this step with %s",
                     fg_status_name((fg_status)status), fg_status_name((fg_status)status));
        return (fg_status)status;
    }
    if (g->data_shards == 1)
        return FG_OK;
    const float inv = 1.0f / (float)g->data_shards;
    float *bufs[2] = {grad_weight, grad_bias};
    const int64_t counts[2] = {weight_floats, bias_floats};
    for (int k = 0; k < 2; k++) {
        if (!bufs[k])
            continue;
        g->data_calls++;
        g->data_bytes += counts[k] * (int64_t)sizeof(float);
        if (fg_mpi_allreduce_floats(g->data, bufs[k], counts[k], MPI_SUM) != 0)
            return FG_ERR_COMMUNICATOR;
        for (int64_t i = 0; i < counts[k]; i++)
            bufs[k][i] *= inv;
    }
    if (loss) {
        g->data_calls++;
        g->data_bytes += (int64_t)sizeof *loss;
        if (MPI_Allreduce(MPI_IN_PLACE, loss, 1, MPI_DOUBLE, MPI_SUM, g->data) != MPI_SUCCESS)
            return FG_ERR_COMMUNICATOR;
        *loss /= g->data_shards;
    }
    return FG_OK;
}
