/* The native radix tree's nodes and holders: layout, links, reference counts and freeing.
   The same rules as services/routing/tree_nodes.py, in C; kvtree.c applies events with them.

Node (28 bytes, packed, one array indexed by node id; node 0 is the root):
  edge   local hash this node was made under: a parent's inline child is valid only when the
         child's edge is the link's key, so the parent needs no key of its own;
  mask   holders 0..63 (a holder is a worker's device or host tier); holders past 63 are
         `extw` more words per node in a parallel array, made only once such a holder exists;
  child  0 (no child), the one child, or MULTI | a child map's index (several children, or a
         link under a key other than the child's edge: an engine reused a block hash);
  parent the node holding its latest link (UNKNOWN once that parent let go of it);
  refs   one per parent link and one per holder lookup entry naming it.
A free node's `parent` links the free list.

Why a leaf no holder holds is unlinked at once, and a node left without holders drops its
children: see tree_nodes.py (the same rules, so the same scores; these are invisible to scores).
*/
#ifndef KVMESH_TREE_CORE_H
#define KVMESH_TREE_CORE_H

#include "block_map.h"

#define ROOT 0u
#define UNKNOWN 0xFFFFFFFFu
#define MULTI 0x80000000u

typedef struct __attribute__((packed)) {
    uint64_t edge;
    uint64_t mask;
    uint32_t child;
    uint32_t parent;
    uint32_t refs;
} Node;

typedef struct {
    Map table;       /* sequence hash -> node: the blocks this holder holds */
    uint64_t marks;  /* nodes carrying this holder's bit */
    int32_t record;  /* its worker's record; -1 when the slot is free */
    uint8_t host;
} Slot;

typedef struct Tree Tree;
static void slot_unmarked(Tree *t, uint32_t s);  /* kvtree.c: a slot's last mark went */

/* Why the last operation that returned a failure failed (t->err). */
#define TREE_NOMEM 1
#define TREE_FULL 2       /* node or map ids ran out: they must stay below MULTI */
#define MAX_NODES MULTI   /* node ids 0 .. MULTI - 1 */
#define MAX_MAPS (MULTI - 1)  /* so MULTI | map index is never UNKNOWN */

/* Out of memory (or ids) an event stops before the block that needed it, and that block left
   nothing behind: the lookup entry's room is made first, a node made for it is returned to the
   free list if its link cannot be made, and a link that cannot be made changes nothing. Freeing
   and unlinking allocate nothing, so they cannot fail half-way. */
struct Tree {
    Node *nodes;     /* cap nodes */
    uint64_t *ext;   /* extw words per node, for extcap nodes (at least `used`): holders 64.. */
    uint32_t extw, extcap, cap, used, free_head, live;
    Map *maps;       /* child maps of nodes with MULTI */
    uint32_t nmaps, capmaps;
    uint32_t free_map;  /* free maps, linked through their `cap`; UNKNOWN ends the list */
    Slot *slots;
    uint32_t nslots, capslots;
    int err;
};

/* -- holder masks ------------------------------------------------------------------------ */

static inline uint64_t *ext_of(Tree *t, uint32_t n) { return t->ext + (size_t)n * t->extw; }

static inline int has_bit(Tree *t, uint32_t n, uint32_t s) {
    if (s < 64) return (int)((t->nodes[n].mask >> s) & 1);
    return (int)((ext_of(t, n)[s / 64 - 1] >> (s % 64)) & 1);
}

static inline void flip_bit(Tree *t, uint32_t n, uint32_t s) {
    if (s < 64) t->nodes[n].mask ^= (uint64_t)1 << s;
    else ext_of(t, n)[s / 64 - 1] ^= (uint64_t)1 << (s % 64);
}

static inline int mask_empty(Tree *t, uint32_t n) {
    if (t->nodes[n].mask) return 0;
    for (uint32_t w = 0; w < t->extw; w++)
        if (ext_of(t, n)[w]) return 0;
    return 1;
}

static inline int masks_equal(Tree *t, uint32_t a, uint32_t b) {
    if (t->nodes[a].mask != t->nodes[b].mask) return 0;
    return t->extw == 0 || memcmp(ext_of(t, a), ext_of(t, b), sizeof(uint64_t) * t->extw) == 0;
}

/* Widens every node's mask to hold `slots` holders; -1 when out of memory (nothing changed). */
static int ensure_mask_width(Tree *t, uint32_t slots) {
    uint32_t want = slots <= 64 ? 0 : (slots - 1) / 64;
    if (want <= t->extw) return 0;
    uint64_t *ext = region_alloc((size_t)t->cap * want * sizeof(uint64_t));
    if (ext == NULL) return -1;
    for (uint32_t n = 0; n < t->used; n++)
        memcpy(ext + (size_t)n * want, ext_of(t, n), sizeof(uint64_t) * t->extw);
    region_free(t->ext, (size_t)t->extcap * t->extw * sizeof(uint64_t));
    t->ext = ext;
    t->extw = want;
    t->extcap = t->cap;
    return 0;
}

/* -- nodes ------------------------------------------------------------------------------- */

/* Room for more nodes; -1 (t->err set) when out of memory or ids, with both arrays as they were
   or the holder words' array alone grown (extcap says how far). Each array's size in bytes is
   always what its capacity says, so region_free/region_resize tell a mapping from a malloc
   block right (they go by size). */
static int grow_nodes(Tree *t) {
    if (t->cap >= MAX_NODES) {
        t->err = TREE_FULL;
        return -1;
    }
    uint64_t want = t->cap < 1024 ? 1024 : (uint64_t)t->cap + t->cap / 2;
    uint32_t cap = want > MAX_NODES ? MAX_NODES : (uint32_t)want;
    if (t->extw && t->extcap < cap) {  /* the holder words first: then a failure leaves `cap` true */
        size_t row = t->extw * sizeof(uint64_t);
        uint64_t *ext = region_resize(t->ext, (size_t)t->extcap * row, (size_t)cap * row);
        if (ext == NULL) {
            t->err = TREE_NOMEM;
            return -1;
        }
        t->ext = ext;
        t->extcap = cap;
    }
    Node *nodes = region_resize(t->nodes, (size_t)t->cap * sizeof(Node), (size_t)cap * sizeof(Node));
    if (nodes == NULL) {
        t->err = TREE_NOMEM;
        return -1;
    }
    t->nodes = nodes;
    t->cap = cap;
    return 0;
}

/* A fresh node (no holder, no child, no reference), made under local hash `edge`; 0 (t->err
   set) when out of memory or ids. */
static uint32_t new_node(Tree *t, uint64_t edge) {
    uint32_t n;
    if (t->free_head != UNKNOWN) {
        n = t->free_head;
        t->free_head = t->nodes[n].parent;
    } else {
        if (t->used == t->cap && grow_nodes(t) != 0) return 0;
        n = t->used++;
    }
    Node *x = &t->nodes[n];
    x->edge = edge;
    x->mask = 0;
    x->child = 0;
    x->parent = UNKNOWN;
    x->refs = 0;
    if (t->extw) memset(ext_of(t, n), 0, sizeof(uint64_t) * t->extw);
    t->live++;
    return n;
}

/* Gives back a node from new_node that was never linked nor named. */
static void discard_node(Tree *t, uint32_t n) {
    t->nodes[n].edge = 0;
    t->nodes[n].parent = t->free_head;
    t->free_head = n;
    t->live--;
}

static inline uint32_t find_child(Tree *t, uint32_t n, uint64_t key) {
    uint32_t c = t->nodes[n].child;
    if (c & MULTI) return map_get(&t->maps[c & ~MULTI], key);
    return c && t->nodes[c].edge == key ? c : 0;
}

/* An empty child map's index; UNKNOWN (t->err set) when out of memory or ids. */
static uint32_t new_map(Tree *t) {
    uint32_t m;
    if (t->free_map != UNKNOWN) {
        m = t->free_map;
        t->free_map = t->maps[m].cap;
    } else {
        if (t->nmaps == t->capmaps) {
            if (t->capmaps >= MAX_MAPS) {
                t->err = TREE_FULL;
                return UNKNOWN;
            }
            uint64_t want = t->capmaps < 64 ? 64 : (uint64_t)t->capmaps * 2;
            uint32_t cap = want > MAX_MAPS ? MAX_MAPS : (uint32_t)want;
            Map *maps = realloc(t->maps, sizeof(Map) * cap);
            if (maps == NULL) {
                t->err = TREE_NOMEM;
                return UNKNOWN;
            }
            t->maps = maps;
            t->capmaps = cap;
        }
        m = t->nmaps++;
    }
    memset(&t->maps[m], 0, sizeof(Map));
    return m;
}

/* Frees a child map's entries and puts it on the free list (allocates nothing). */
static void free_map(Tree *t, uint32_t m) {
    map_free(&t->maps[m]);
    t->maps[m].cap = t->free_map;
    t->free_map = m;
}

/* Links `child` under `n` by local hash `key` (no child of n has that key yet); -1 (t->err set)
   when out of memory or ids, with nothing changed. */
static int link_child(Tree *t, uint32_t n, uint64_t key, uint32_t child) {
    uint32_t c = t->nodes[n].child;
    int oom = 0;
    if (c == 0 && t->nodes[child].edge == key) {
        t->nodes[n].child = child;
    } else if (c & MULTI) {
        map_put(&t->maps[c & ~MULTI], key, child, &oom);
        if (oom) {
            t->err = TREE_NOMEM;
            return -1;
        }
    } else {
        uint32_t m = new_map(t);
        if (m == UNKNOWN) return -1;
        if (c) map_put(&t->maps[m], t->nodes[c].edge, c, &oom);
        if (!oom) map_put(&t->maps[m], key, child, &oom);
        if (oom) {  /* the inline child stays where it was */
            free_map(t, m);
            t->err = TREE_NOMEM;
            return -1;
        }
        t->nodes[n].child = MULTI | m;
    }
    t->nodes[child].refs++;
    t->nodes[child].parent = n;
    return 0;
}

/* Child c loses its link from n: it forgets n as its latest parent, and joins the list `pending`
   (linked through `parent`) once nothing references it. Returns the list. */
static uint32_t unref_child(Tree *t, uint32_t n, uint32_t c, uint32_t pending) {
    if (--t->nodes[c].refs == 0) {
        t->nodes[c].parent = pending;
        return c;
    }
    if (t->nodes[c].parent == n) t->nodes[c].parent = UNKNOWN;
    return pending;
}

/* Frees `node` (nothing references it) and every node below it that nothing else references.
   The nodes to free wait in a list through their `parent` field, so this allocates nothing. */
static void free_nodes_from(Tree *t, uint32_t node) {
    uint32_t pending = node;
    t->nodes[node].parent = UNKNOWN;
    while (pending != UNKNOWN) {
        uint32_t n = pending;
        pending = t->nodes[n].parent;
        uint32_t c = t->nodes[n].child;
        t->nodes[n].child = 0;
        if (c & MULTI) {
            Map *m = &t->maps[c & ~MULTI];
            for (uint32_t i = 0; i < m->cap; i++)
                if (m->e[i].value) pending = unref_child(t, n, m->e[i].value, pending);
            free_map(t, c & ~MULTI);
        } else if (c) {
            pending = unref_child(t, n, c, pending);
        }
        for (uint32_t w = 0; w <= t->extw; w++) {  /* stale marks of holders whose lookup moved on */
            uint64_t bits = w == 0 ? t->nodes[n].mask : ext_of(t, n)[w - 1];
            while (bits) {
                uint32_t s = w * 64 + (uint32_t)__builtin_ctzll(bits);
                bits &= bits - 1;
                if (--t->slots[s].marks == 0) slot_unmarked(t, s);
            }
        }
        t->nodes[n].mask = 0;
        if (t->extw) memset(ext_of(t, n), 0, sizeof(uint64_t) * t->extw);
        t->nodes[n].edge = 0;
        t->nodes[n].parent = t->free_head;
        t->free_head = n;
        t->live--;
    }
}

static void release(Tree *t, uint32_t n);

/* Unlinks n from its latest parent if n is a leaf no holder holds and that link is its only
   reference. */
static void prune_if_empty_leaf(Tree *t, uint32_t n) {
    uint32_t p = t->nodes[n].parent;
    if (p == UNKNOWN || t->nodes[n].child || !mask_empty(t, n)) return;
    uint32_t c = t->nodes[p].child;
    if (c & MULTI) {
        Map *m = &t->maps[c & ~MULTI];
        if (map_get(m, t->nodes[n].edge) != n) return;  /* linked there under a reused hash: kept */
        map_del(m, t->nodes[n].edge);
        if (m->count == 0) {  /* map_del freed its entries */
            free_map(t, c & ~MULTI);
            t->nodes[p].child = 0;
        } else if (m->count == 1) {  /* back to an inline child when its key is its edge */
            uint32_t i = 0;
            while (m->e[i].value == 0) i++;
            if (t->nodes[m->e[i].value].edge == m->e[i].key) {
                t->nodes[p].child = m->e[i].value;
                free_map(t, c & ~MULTI);
            }
        }
    } else if (c == n) {
        t->nodes[p].child = 0;
    } else {
        return;
    }
    t->nodes[n].parent = UNKNOWN;
    release(t, n);
}

/* Drops one reference to n; frees it once nothing references it. */
static void release(Tree *t, uint32_t n) {
    uint32_t left = --t->nodes[n].refs;
    if (left == 1) prune_if_empty_leaf(t, n);
    else if (left == 0) free_nodes_from(t, n);
}

/* Unlinks every child of n (their latest parent forgets n), then drops each link's reference. */
static void drop_children(Tree *t, uint32_t n) {
    uint32_t c = t->nodes[n].child;
    t->nodes[n].child = 0;
    if (c & MULTI) {
        Map m = t->maps[c & ~MULTI];  /* detached: the releases below never see it */
        t->maps[c & ~MULTI] = (Map){NULL, 0, 0};
        free_map(t, c & ~MULTI);
        for (uint32_t i = 0; i < m.cap; i++)
            if (m.e[i].value && t->nodes[m.e[i].value].parent == n) t->nodes[m.e[i].value].parent = UNKNOWN;
        for (uint32_t i = 0; i < m.cap; i++)
            if (m.e[i].value) release(t, m.e[i].value);
        map_free(&m);
    } else if (c) {
        if (t->nodes[c].parent == n) t->nodes[c].parent = UNKNOWN;
        release(t, c);
    }
}

/* Holder s lets go of node n (one of its lookup entries named it, now gone). */
static void let_go(Tree *t, uint32_t s, uint32_t n) {
    if (has_bit(t, n, s)) {
        flip_bit(t, n, s);
        t->slots[s].marks--;
    }
    /* No holder holds this block, so none can use anything below it (Dynamo's rule). */
    if (mask_empty(t, n)) drop_children(t, n);
}

#endif
