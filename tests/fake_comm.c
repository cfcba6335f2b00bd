/* The in-process test communicator (see fake_comm.h). */
#define _POSIX_C_SOURCE 200809L
#include "fake_comm.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RANKS 16

typedef struct rank_slot {
    struct fake_comm *c;
    int rank;
} rank_slot;

struct fake_comm {
    pthread_barrier_t barrier;
    int shards;
    float *bufs[MAX_RANKS];
    int64_t counts[MAX_RANKS];
    rank_slot slots[MAX_RANKS];
    long calls;
};

static int allreduce(void *user, float *buf, int64_t count, fg_reduce_op op)
{
    rank_slot *rs = user;
    struct fake_comm *c = rs->c;
    c->bufs[rs->rank] = buf;
    c->counts[rs->rank] = count;
    pthread_barrier_wait(&c->barrier);
    int mismatch = 0;
    for (int r = 0; r < c->shards; r++)
        mismatch |= c->counts[r] != count;
    float *tmp = mismatch ? NULL : malloc((size_t)count * sizeof(float) + 1);
    for (int64_t i = 0; tmp && i < count; i++) {
        float acc = c->bufs[0][i];
        for (int r = 1; r < c->shards; r++) {
            const float v = c->bufs[r][i];
            acc = op == FG_REDUCE_MAX ? (v > acc ? v : acc) : acc + v;
        }
        tmp[i] = acc;
    }
    pthread_barrier_wait(&c->barrier); /* everyone has read everyone */
    if (tmp)
        memcpy(buf, tmp, (size_t)count * sizeof(float));
    free(tmp);
    if (rs->rank == 0)
        c->calls++;
    pthread_barrier_wait(&c->barrier);
    return mismatch;
}

fake_comm *fake_comm_create(int shards)
{
    if (shards < 1 || shards > MAX_RANKS)
        return NULL;
    fake_comm *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->shards = shards;
    pthread_barrier_init(&c->barrier, NULL, (unsigned)shards);
    for (int r = 0; r < shards; r++)
        c->slots[r] = (rank_slot){c, r};
    return c;
}

void fake_comm_destroy(fake_comm *c)
{
    if (!c)
        return;
    pthread_barrier_destroy(&c->barrier);
    free(c);
}

fg_communicator fake_comm_rank(fake_comm *c, int rank)
{
    fg_communicator comm = {allreduce, &c->slots[rank]};
    return comm;
}

long fake_comm_calls(const fake_comm *c) { return c->calls; }
