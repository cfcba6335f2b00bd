/* gradcheck and bench across MPI ranks (see sharded.h). */
#include "sharded.h"

#include <stdlib.h>
#include <string.h>

int ft_sharded_wanted(const ft_config *cfg) { return cfg->vocab_shards * cfg->data_shards > 1; }

#ifndef FT_HAVE_MPI

struct ft_shards {
    int unused;
};

int ft_sharded_init(ft_shards **out, const ft_config *cfg, char *err, size_t errlen)
{
    (void)cfg;
    *out = NULL;
    return ft_error(err, errlen,
                    "vocab_shards / data_shards need MPI: this fusedgrpo was built without it "
                    "(install libopenmpi-dev and rebuild)");
}
int ft_sharded_step(ft_shards *s, ft_runner *r, int assemble)
{
    (void)s;
    (void)assemble;
    return ft_error(r->err, sizeof r->err, "built without MPI");
}
int ft_sharded_rank(const ft_shards *s) { return s ? 0 : 0; }
void ft_sharded_traffic(const ft_shards *s, double *h, double *d, double *n)
{
    (void)s;
    *h = *d = *n = 0;
}
double ft_sharded_max(const ft_shards *s, double x) { return s ? x : x; }
void ft_sharded_finish(ft_shards *s) { (void)s; }

#else

#include "fusedgrpo_mpi.h"

struct ft_shards {
    fg_mpi_grid grid;
    fg_context *ctx; /* with the hook on the grid's row */
    int64_t steps;
};

int ft_sharded_init(ft_shards **out, const ft_config *cfg, char *err, size_t errlen)
{
    *out = NULL;
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited && MPI_Init(NULL, NULL) != MPI_SUCCESS)
        return ft_error(err, errlen, "MPI_Init failed");
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const int64_t want = cfg->vocab_shards * cfg->data_shards;
    if (size != want)
        return ft_error(err, errlen,
                        "vocab_shards x data_shards = %lld ranks, but mpirun started %d "
                        "(mpirun -np %lld)",
                        (long long)want, size, (long long)want);
    if (cfg->batch % cfg->data_shards != 0)
        return ft_error(err, errlen,
                        "data_shards = %lld must divide batch = %lld: every row of ranks holds the "
                        "same number of sequences (DDP's per-device batch), so that their mean is "
                        "the whole batch's loss",
                        (long long)cfg->data_shards, (long long)cfg->batch);
    if (cfg->data_shards > 1 &&
        (cfg->loss_type == FG_LOSS_BNPO || cfg->entropy_coef != 0 || cfg->top_entropy_quantile < 1))
        return ft_error(err, errlen,
                        "with data_shards > 1, bnpo, the entropy bonus and the entropy quantile "
                        "normalise by each row's own tokens (TRL under DDP), which is not the "
                        "single-process loss this command checks");
    if (cfg->vocab_shards > cfg->vocab)
        return ft_error(err, errlen, "vocab_shards = %lld > vocab = %lld",
                        (long long)cfg->vocab_shards, (long long)cfg->vocab);
    ft_shards *s = calloc(1, sizeof *s);
    if (!s)
        return ft_error(err, errlen, "out of memory");
    fg_status st = fg_mpi_grid_create(MPI_COMM_WORLD, (int)cfg->vocab_shards, &s->grid);
    if (st != FG_OK) {
        free(s);
        return ft_error(err, errlen, "fg_mpi_grid_create: %s", fg_status_name(st));
    }
    fg_context_options o;
    fg_context_options_init(&o);
    o.threads = (int)cfg->threads;
    o.memory_budget = cfg->memory_budget == FT_BUDGET_MIN ? 0 : (size_t)cfg->memory_budget;
    o.check_finite = cfg->check_finite;
    o.comm = fg_mpi_communicator(&s->grid);
    if ((st = fg_context_create(&o, &s->ctx)) != FG_OK) {
        fg_mpi_grid_free(&s->grid);
        free(s);
        return ft_error(err, errlen, "fg_context_create: %s", fg_status_name(st));
    }
    *out = s;
    return 0;
}

int ft_sharded_rank(const ft_shards *s) { return s->grid.rank; }

/* In place over comm: the buffers are zero outside each rank's own part, so
 * a SUM assembles them exactly. */
static int assemble_sum(float *buf, int64_t n, MPI_Comm comm)
{
    return fg_mpi_allreduce_floats(comm, buf, n, MPI_SUM);
}

static void zero_outside(float *buf, int64_t total, int64_t start, int64_t count)
{
    memset(buf, 0, (size_t)start * sizeof(float));
    memset(buf + start + count, 0, (size_t)(total - start - count) * sizeof(float));
}

int ft_sharded_step(ft_shards *s, ft_runner *r, int assemble)
{
    const fg_mpi_grid *g = &s->grid;
    const ft_config *c = &r->p->s;
    const int64_t B = c->batch, T = c->seq_len, H = c->hidden, V = c->vocab, N = B * T;
    const size_t es = ft_dtype_size(c->dtype);
    int64_t v0, vc, b0, bc;
    fg_mpi_split(V, g->vocab_shards, g->vocab_rank, &v0, &vc);
    fg_mpi_split(B, g->data_shards, g->data_rank, &b0, &bc);
    const int64_t n0 = b0 * T, nc = bc * T;

    /* This rank's inputs: its sequences, its weight rows. */
    fg_linear_inputs in = r->lin;
    in.hidden = fg_matrix_make((char *)r->lin.hidden.data + (size_t)n0 * (size_t)H * es, c->dtype, nc, H);
    in.weight = fg_matrix_make((char *)r->lin.weight.data + (size_t)v0 * (size_t)H * es, c->dtype, vc, H);
    if (r->lin.bias.data)
        in.bias = fg_vector_make((char *)r->lin.bias.data + (size_t)v0 * es, c->dtype, vc);
    in.vocab_start = v0;
    in.vocab_total = V;
    fg_batch b = r->batch;
    b.batch = bc;
    b.token_ids += n0;
    b.mask += n0;
    b.advantages += b0;
    if (b.old_logp)
        b.old_logp += n0;
    if (b.ref_logp)
        b.ref_logp += n0;
    if (b.is_ratio)
        b.is_ratio += b.is_ratio_per_sequence ? b0 : n0;
    fg_loss_config loss = r->loss;
    if (g->data_shards > 1 && loss.num_items_in_batch < 0) /* TRL: global count / processes */
        loss.num_items_in_batch = (double)ft_problem_unmasked(r->p) / (double)g->data_shards;

    /* Outputs: this rank's rows of the whole buffers (grad_weight: its vocab rows). */
    fg_linear_outputs o;
    memset(&o, 0, sizeof o);
    o.logp = r->logp + n0;
    o.entropy = r->entropy + n0;
    o.grad_hidden = fg_matrix_make(r->grad_hidden + n0 * H, FG_DTYPE_F32, nc, H);
    o.grad_weight = fg_matrix_make(r->grad_weight + v0 * H, FG_DTYPE_F32, vc, H);
    if (r->grad_bias)
        o.grad_bias = fg_vector_make(r->grad_bias + v0, FG_DTYPE_F32, vc);
    fg_status st = fg_linear_grpo(s->ctx, &r->lopts, &loss, &in, &b, &o, &r->exec);
    char msg[512] = "";
    if (st != FG_OK)
        snprintf(msg, sizeof msg, "%s", fg_last_error(s->ctx));
    double lossv = o.loss;
    st = fg_mpi_data_parallel_end(&s->grid, st, &lossv, o.grad_weight.data, vc * H,
                                  r->grad_bias ? r->grad_bias + v0 : NULL, vc,
                                  msg[0] ? NULL : msg, sizeof msg);
    s->steps++;
    if (st != FG_OK)
        return ft_error(r->err, sizeof r->err, "rank %d: fg_linear_grpo: %s", g->rank, msg);
    r->loss_value = lossv;
    if (!assemble)
        return 0;

    /* The whole outputs on every rank. The mean over the rows scales each
     * row's grad_hidden by 1 / data_shards; metrics are averaged likewise. */
    const float inv = 1.0f / (float)g->data_shards;
    for (int64_t i = 0; i < nc * H; i++)
        r->grad_hidden[n0 * H + i] *= inv;
    zero_outside(r->logp, N, n0, nc);
    zero_outside(r->entropy, N, n0, nc);
    zero_outside(r->grad_hidden, N * H, n0 * H, nc * H);
    zero_outside(r->grad_weight, V * H, v0 * H, vc * H);
    if (r->grad_bias)
        zero_outside(r->grad_bias, V, v0, vc);
    double m[sizeof o.metrics / sizeof(double)];
    memcpy(m, &o.metrics, sizeof m);
    if (assemble_sum(r->logp, N, g->data) || assemble_sum(r->entropy, N, g->data) ||
        assemble_sum(r->grad_hidden, N * H, g->data) ||
        assemble_sum(r->grad_weight, V * H, g->vocab) ||
        (r->grad_bias && assemble_sum(r->grad_bias, V, g->vocab)) ||
        MPI_Allreduce(MPI_IN_PLACE, m, (int)(sizeof m / sizeof m[0]), MPI_DOUBLE, MPI_SUM, g->data) !=
            MPI_SUCCESS)
        return ft_error(r->err, sizeof r->err, "MPI_Allreduce failed assembling the outputs");
    for (size_t k = 0; k < sizeof m / sizeof m[0]; k++)
        m[k] /= g->data_shards;
    memcpy(&r->metrics, m, sizeof m);
    r->loss_value = lossv;
    return 0;
}

void ft_sharded_traffic(const ft_shards *s, double *hook_bytes, double *data_bytes,
                        double *reductions)
{
    const double k = s->steps > 0 ? (double)s->steps : 1.0;
    *hook_bytes = (double)s->grid.hook_bytes / k;
    *data_bytes = (double)s->grid.data_bytes / k;
    *reductions = (double)(s->grid.hook_calls + s->grid.data_calls) / k;
}

double ft_sharded_max(const ft_shards *s, double x)
{
    MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_MAX, s->grid.world);
    return x;
}

void ft_sharded_finish(ft_shards *s)
{
    if (s) {
        fg_context_destroy(s->ctx);
        fg_mpi_grid_free(&s->grid);
        free(s);
    }
    int inited = 0, finalized = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (inited && !finalized)
        MPI_Finalize();
}

#endif
