/* Config parsing: the key table's defaults, YAML files good and bad (each
 * error must name file, line and key), --set overrides and the print ->
 * parse round trip that a printed config file relies on. */
#include "config.h"
#include "check.h"

#include <math.h>
#include <string.h>

static char data_dir[512];

static const char *data(const char *name)
{
    static char path[700];
    snprintf(path, sizeof path, "%s/%s", data_dir, name);
    return path;
}

/* Loading `name` must fail, and the message must contain every needle. */
static void expect_error(const char *name, const char *needle1, const char *needle2)
{
    ft_config cfg;
    char err[512] = "";
    ft_config_defaults(&cfg);
    ft_config before = cfg;
    CHECK(ft_config_load_file(&cfg, data(name), err, sizeof err) != 0);
    fprintf(stderr, "  %s -> %s\n", name, err);
    CHECK(strstr(err, data(name)) != NULL);
    CHECK(needle1 == NULL || strstr(err, needle1) != NULL);
    CHECK(needle2 == NULL || strstr(err, needle2) != NULL);
    CHECK(memcmp(&cfg, &before, sizeof cfg) == 0); /* a failed load changes nothing */
}

static void test_units(void)
{
    uint64_t b;
    int64_t i;
    double d;
    int v;
    CHECK(ft_parse_bytes("128MiB", &b) == 0 && b == 128u << 20);
    CHECK(ft_parse_bytes("1.5GiB", &b) == 0 && b == 3u << 29);
    CHECK(ft_parse_bytes("2g", &b) == 0 && b == 2ull << 30);
    CHECK(ft_parse_bytes("500MB", &b) == 0 && b == 500000000u);
    CHECK(ft_parse_bytes("4096", &b) == 0 && b == 4096);
    CHECK(ft_parse_bytes("12 MiB", &b) == 0 && b == 12u << 20);
    CHECK(ft_parse_bytes("1e9", &b) == 0 && b == 1000000000u);
    CHECK(ft_parse_bytes("12XB", &b) != 0);
    CHECK(ft_parse_bytes("-1", &b) != 0);
    CHECK(ft_parse_bytes("0.5", &b) != 0);
    CHECK(ft_parse_bytes("", &b) != 0);
    CHECK(ft_parse_int64("12", &i) == 0 && i == 12);
    CHECK(ft_parse_int64("12x", &i) != 0);
    CHECK(ft_parse_int64(" 12", &i) != 0);
    CHECK(ft_parse_int64("99999999999999999999", &i) != 0);
    CHECK(ft_parse_double("0.25", &d) == 0 && d == 0.25);
    CHECK(ft_parse_double("nan", &d) != 0);
    CHECK(ft_parse_double("inf", &d) != 0);
    CHECK(ft_parse_double("1e999", &d) != 0);
    CHECK(ft_parse_bool("Yes", &v) == 0 && v == 1);
    CHECK(ft_parse_bool("off", &v) == 0 && v == 0);
    CHECK(ft_parse_bool("2", &v) != 0);
    char buf[64];
    ft_format_bytes(128u << 20, buf, sizeof buf);
    CHECK(strcmp(buf, "128MiB") == 0);
    ft_format_bytes(1000, buf, sizeof buf);
    CHECK(strcmp(buf, "1000") == 0);
}

static void test_good_file(void)
{
    ft_config cfg;
    char err[512] = "";
    ft_config_defaults(&cfg);
    int rc = ft_config_load_file(&cfg, data("good.yaml"), err, sizeof err);
    if (rc != 0)
        fprintf(stderr, "  good.yaml: %s\n", err);
    CHECK(rc == 0);
    CHECK(cfg.batch == 3 && cfg.seq_len == 17 && cfg.hidden == 32 && cfg.vocab == 101);
    CHECK(cfg.dtype == FG_DTYPE_BF16 && cfg.impl == FT_IMPL_LOGITS);
    CHECK(cfg.memory_budget == 64u << 20);
    CHECK(cfg.loss_type == FG_LOSS_GRPO);
    CHECK(cfg.epsilon_high == 0.28);
    CHECK(isnan(cfg.delta));
    CHECK(cfg.max_completion_length == -1);
    CHECK(cfg.use_bias == 1);
    CHECK(cfg.temperature == 0.7);
    CHECK(cfg.seed == 42);
    CHECK(cfg.epsilon_low == 0.2); /* untouched keys keep their defaults */
}

static void test_bad_files(void)
{
    expect_error("unknown_key.yaml", ":5:", "'vocabulary'");
    expect_error("bad_type.yaml", ":2:", "'seq_len'");
    expect_error("nested.yaml", ":2:", "'loss'");
    expect_error("duplicate.yaml", ":3:", "'batch'");
    expect_error("syntax.yaml", "YAML syntax error", NULL);
    expect_error("list_value.yaml", ":2:", "'hidden'");
    expect_error("bad_enum.yaml", ":1:", "'dtype'");
    expect_error("does_not_exist.yaml", "cannot open", NULL);
}

static void test_set(void)
{
    ft_config cfg;
    char err[512] = "";
    ft_config_defaults(&cfg);
    CHECK(ft_config_set_assignment(&cfg, "seq_len=33", err, sizeof err) == 0 && cfg.seq_len == 33);
    CHECK(ft_config_set_assignment(&cfg, "memory_budget=1GiB", err, sizeof err) == 0 &&
          cfg.memory_budget == 1u << 30);
    CHECK(ft_config_set_assignment(&cfg, "tol_grad_rel=1e-30", err, sizeof err) == 0 &&
          cfg.tol_grad_rel == 1e-30);
    CHECK(ft_config_set_assignment(&cfg, "epsilon_high=auto", err, sizeof err) == 0 &&
          isnan(cfg.epsilon_high));
    CHECK(ft_config_set_assignment(&cfg, "bogus=1", err, sizeof err) != 0);
    CHECK(strstr(err, "--set") && strstr(err, "'bogus'"));
    CHECK(ft_config_set_assignment(&cfg, "batch=0", err, sizeof err) != 0);
    CHECK(strstr(err, "out of range"));
    CHECK(ft_config_set_assignment(&cfg, "batch=1.5", err, sizeof err) != 0);
    CHECK(ft_config_set_assignment(&cfg, "use_bias=maybe", err, sizeof err) != 0);
    CHECK(ft_config_set_assignment(&cfg, "noequals", err, sizeof err) != 0);
    CHECK(ft_config_set_assignment(&cfg, "temperature=0", err, sizeof err) != 0);

    /* Loss types and levels are the library's names and values. */
    CHECK(ft_config_set_assignment(&cfg, "loss_type=sapo", err, sizeof err) == 0 &&
          cfg.loss_type == FG_LOSS_SAPO);
    CHECK(ft_config_set_assignment(&cfg, "importance_sampling_level=sequence", err, sizeof err) == 0 &&
          cfg.importance_sampling_level == FG_LEVEL_SEQUENCE);
    CHECK(ft_config_set_assignment(&cfg, "loss_type=ppo", err, sizeof err) != 0);
    CHECK(strstr(err, "grpo | bnpo | dr_grpo | dapo | luspo | cispo | sapo") != NULL);

    /* --set after a file wins over the file. */
    ft_config_defaults(&cfg);
    CHECK(ft_config_load_file(&cfg, data("good.yaml"), err, sizeof err) == 0);
    CHECK(ft_config_set_assignment(&cfg, "batch=5", err, sizeof err) == 0 && cfg.batch == 5);

    /* Cross-key check. */
    ft_config_defaults(&cfg);
    CHECK(ft_config_set_assignment(&cfg, "beta=0.1", err, sizeof err) == 0);
    CHECK(ft_config_check(&cfg, err, sizeof err) != 0 && strstr(err, "use_ref_logp"));
}

/* format(key) -> set(key) must reproduce the config bit for bit. */
static void test_round_trip(void)
{
    ft_config a, b;
    char err[512];
    ft_config_defaults(&a);
    CHECK(ft_config_load_file(&a, data("good.yaml"), err, sizeof err) == 0);
    a.temperature = 0.1 + 0.2; /* not a short decimal */
    ft_config_defaults(&b);
    for (size_t i = 0; i < ft_config_key_count(); i++) {
        char val[128];
        const char *k = ft_config_key_name(i);
        CHECK(ft_config_format(&a, k, val, sizeof val) == 0);
        CHECK(ft_config_set(&b, k, val, "round-trip", 0, err, sizeof err) == 0);
    }
    CHECK(memcmp(&a, &b, sizeof a) == 0);
}

int main(int argc, char **argv)
{
    snprintf(data_dir, sizeof data_dir, "%s", argc > 1 ? argv[1] : "tests/tool/data");
    test_units();
    test_good_file();
    test_bad_files();
    test_set();
    test_round_trip();
    return TEST_RESULT();
}
