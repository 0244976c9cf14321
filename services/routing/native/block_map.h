/* Memory regions and the one hash map the native index uses (64-bit key -> 32-bit value).

Regions: an array of 256 KiB or more is its own anonymous mapping, grown with mremap and
unmapped when freed, so the pages go back to the system at once (malloc may keep them in its
heap). That keeps the replay's measure honest: the resident memory given back when the index is
dropped is the index's. Smaller arrays come from malloc. Which of the two a region is follows
from its size, so every caller passes a region's exact size in bytes to region_resize and
region_free (an array's capacity must stay true even when growing a neighbour failed).

The map: open addressing with linear probing over packed 12-byte (key, value) entries; value 0
marks a free entry (node 0 is the root, never a value). A key's home entry is the high bits of
(key * odd constant) scaled to the capacity, so any capacity works and the table grows by 1.5x,
keeping between half and three quarters of its entries in use: 16 to 24 bytes per entry. Deleting
shifts later entries of the probe run back (no tombstones), so a table never fills with dead
entries and lookups stay short after heavy eviction.
*/
#ifndef KVMESH_BLOCK_MAP_H
#define KVMESH_BLOCK_MAP_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define REGION_MMAP_MIN ((size_t)1 << 18)

static void *region_alloc(size_t bytes) {
    if (bytes == 0) return NULL;
    if (bytes >= REGION_MMAP_MIN) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    }
    return calloc(1, bytes);
}

static void region_free(void *p, size_t bytes) {
    if (p == NULL) return;
    if (bytes >= REGION_MMAP_MIN) munmap(p, bytes);
    else free(p);
}

/* Grows (or shrinks) a region, keeping its contents; the new tail is zeroed. */
static void *region_resize(void *old, size_t old_bytes, size_t new_bytes) {
    if (old == NULL || old_bytes == 0) return region_alloc(new_bytes);
    if (old_bytes >= REGION_MMAP_MIN && new_bytes >= REGION_MMAP_MIN) {
        void *p = mremap(old, old_bytes, new_bytes, MREMAP_MAYMOVE);  /* fresh pages read as zero */
        return p == MAP_FAILED ? NULL : p;
    }
    void *p = region_alloc(new_bytes);
    if (p == NULL) return NULL;
    memcpy(p, old, old_bytes < new_bytes ? old_bytes : new_bytes);
    region_free(old, old_bytes);
    return p;
}

typedef struct __attribute__((packed)) {
    uint64_t key;
    uint32_t value;
} MapEntry;

typedef struct {
    MapEntry *e;
    uint32_t cap;
    uint32_t count;
} Map;

#define MAP_MIN_CAP 4u

static inline uint32_t map_home(uint64_t key, uint32_t cap) {
    return (uint32_t)(((unsigned __int128)(key * 0x9E3779B97F4A7C15ull) * cap) >> 64);
}

static inline uint32_t map_get(const Map *m, uint64_t key) {
    if (m->count == 0) return 0;
    uint32_t i = map_home(key, m->cap);
    for (;;) {
        const MapEntry *x = &m->e[i];
        if (x->value == 0) return 0;
        if (x->key == key) return x->value;
        if (++i == m->cap) i = 0;
    }
}

static void map_free(Map *m) {
    region_free(m->e, (size_t)m->cap * sizeof(MapEntry));
    m->e = NULL;
    m->cap = m->count = 0;
}

/* Lays the entries out afresh in `cap` entries; 0 on success, -1 when out of memory. */
static int map_rehash(Map *m, uint32_t cap) {
    MapEntry *e = region_alloc((size_t)cap * sizeof(MapEntry));
    if (e == NULL) return -1;
    for (uint32_t j = 0; j < m->cap; j++) {
        if (m->e[j].value == 0) continue;
        uint32_t i = map_home(m->e[j].key, cap);
        while (e[i].value != 0) {
            if (++i == cap) i = 0;
        }
        e[i] = m->e[j];
    }
    region_free(m->e, (size_t)m->cap * sizeof(MapEntry));
    m->e = e;
    m->cap = cap;
    return 0;
}

/* Makes room for `extra` more keys, so that that many map_put calls cannot run out of memory;
   -1 when out of memory (nothing changed). */
static int map_reserve(Map *m, uint32_t extra) {
    uint64_t need = (uint64_t)m->count + extra;
    if (need * 4 <= (uint64_t)m->cap * 3) return 0;
    uint64_t cap = m->cap < MAP_MIN_CAP ? MAP_MIN_CAP : m->cap;
    while (need * 4 > cap * 3) cap += cap / 2;
    if (cap > 0xFFFFFFF0u) return -1;
    return map_rehash(m, (uint32_t)cap);
}

/* Sets key -> value (value != 0); returns the previous value (0 when none). Out of memory sets
   *oom and changes nothing. */
static inline uint32_t map_put(Map *m, uint64_t key, uint32_t value, int *oom) {
    if (map_reserve(m, 1) != 0) {
        *oom = 1;
        return 0;
    }
    uint32_t i = map_home(key, m->cap);
    for (;;) {
        MapEntry *x = &m->e[i];
        if (x->value == 0) {
            x->key = key;
            x->value = value;
            m->count++;
            return 0;
        }
        if (x->key == key) {
            uint32_t previous = x->value;
            x->value = value;
            return previous;
        }
        if (++i == m->cap) i = 0;
    }
}

/* Removes key; returns its value (0 when absent). Later entries of the run shift back. */
static inline uint32_t map_del(Map *m, uint64_t key) {
    if (m->count == 0) return 0;
    uint32_t cap = m->cap, i = map_home(key, cap);
    for (;;) {
        if (m->e[i].value == 0) return 0;
        if (m->e[i].key == key) break;
        if (++i == cap) i = 0;
    }
    uint32_t value = m->e[i].value, j = i;
    for (;;) {
        if (++j == cap) j = 0;
        if (m->e[j].value == 0) break;
        uint32_t home = map_home(m->e[j].key, cap);
        /* The entry at j may move to the hole at i only if its home is not in (i, j]. */
        int stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!stays) {
            m->e[i] = m->e[j];
            i = j;
        }
    }
    m->e[i].value = 0;
    m->e[i].key = 0;
    m->count--;
    if (m->count == 0) map_free(m);
    return value;
}

#endif
