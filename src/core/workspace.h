/*
 * The working memory of a call: one arena carved by a bump pointer. The
 * owner passes its count of held bytes (*held), which moves with every
 * mapping, so fg_memory_stats reports what is really held.
 *
 * The context keeps an arena across calls (page faults are slow, so memory
 * is mapped once with MAP_POPULATE and reused); a call that brings its own
 * workspace (fg_exec.workspace) runs on a borrowed arena over the caller's
 * memory instead. Either way every per-call buffer comes out of fg_arena_take,
 * so the counted peak is the real working memory.
 */
#ifndef FG_WORKSPACE_H
#define FG_WORKSPACE_H

#include <stddef.h>

#include "fusedgrpo.h"

typedef struct fg_arena {
    unsigned char *base;
    size_t capacity;
    size_t used;  /* bump pointer of the current call */
    int borrowed; /* caller memory: never mapped or unmapped here */
} fg_arena;

/* An owned arena holding at least `bytes`, reset. Kept when it fits and is
 * at most keep_limit (the call's budget), or at most 2 * bytes when bytes
 * exceeds keep_limit; else remapped (the old one is unmapped
 * first, so a failed remap holds none). *held is the count of held bytes:
 * it moves by the change in mapping. FG_ERR_OUT_OF_MEMORY on failure. */
fg_status fg_arena_reserve(fg_arena *a, size_t bytes, size_t keep_limit, size_t *held);
void fg_arena_release(fg_arena *a, size_t *held);

/* A borrowed arena over caller memory (never freed here). */
void fg_arena_borrow(fg_arena *a, void *mem, size_t bytes);

/* An aligned block from the arena; NULL if it does not fit (never happens
 * when the call reserved what its plan counts). */
void *fg_arena_take(fg_arena *a, size_t bytes);

/* Bytes a block of `bytes` occupies in the arena once aligned. */
size_t fg_ws_round(size_t bytes);
/* The arena's real size for `bytes`: whole pages. */
size_t fg_ws_page_round(size_t bytes);

#endif
