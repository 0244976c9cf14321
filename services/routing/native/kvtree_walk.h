/* Scoring, part of kvtree.c: the walk from the root along a prompt's local hashes.

The walk adds a *run* of levels whose nodes carry equal holder masks at once, so a match costs
O(depth + mask changes x holders), not a touch of every holder at every level. A level a host
slot holds counts for that worker's host tier only where its device slot does not hold it too.
*/

static void add_run(KvTree *self, uint32_t n, uint32_t levels) {
    Tree *t = &self->t;
    for (uint32_t w = 0; w <= t->extw; w++) {
        uint64_t bits = w == 0 ? t->nodes[n].mask : ext_of(t, n)[w - 1];
        while (bits) {
            uint32_t s = w * 64 + (uint32_t)__builtin_ctzll(bits);
            bits &= bits - 1;
            if (t->slots[s].host) {
                int32_t device = self->recs[t->slots[s].record].slot[0];
                if (device >= 0 && has_bit(t, n, (uint32_t)device)) continue;  /* a device hit */
            }
            self->counts[s] += levels;
        }
    }
}

/* Scores into a new dict of device hits, and into `*host` when it is not NULL. */
static PyObject *walk(KvTree *self, PyObject *hashes, PyObject **host) {
    PyObject *seq = PySequence_Fast(hashes, "local_hashes must be a sequence");
    if (seq == NULL) return NULL;
    Tree *t = &self->t;
    Py_ssize_t total = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint32_t node = ROOT, run = 0, levels = 0;
    for (Py_ssize_t i = 0; i < total; i++) {
        uint64_t h;
        uint32_t c;
        if (read_u64(items[i], &h) != 0 || !(c = find_child(t, node, h))) break;
        node = c;
        if (run && masks_equal(t, run, c)) {
            levels++;
            continue;
        }
        if (run) add_run(self, run, levels);
        run = c;
        levels = 1;
    }
    if (run) add_run(self, run, levels);
    Py_DECREF(seq);
    PyObject *device = PyDict_New();
    if (host != NULL) *host = PyDict_New();
    int failed = device == NULL || (host != NULL && *host == NULL);
    for (uint32_t s = 0; s < t->nslots; s++) {
        uint32_t n = self->counts[s];
        if (n == 0) continue;
        self->counts[s] = 0;
        PyObject *into = t->slots[s].host ? (host ? *host : NULL) : device;
        if (into == NULL || failed) continue;
        PyObject *count = PyLong_FromUnsignedLong(n);
        if (count == NULL || PyDict_SetItem(into, self->recs[t->slots[s].record].name, count) < 0) failed = 1;
        Py_XDECREF(count);
    }
    if (failed) {
        Py_XDECREF(device);
        if (host != NULL) Py_CLEAR(*host);
        return NULL;
    }
    return device;
}

static PyObject *tree_find_matches(KvTree *self, PyObject *hashes) { return walk(self, hashes, NULL); }

static PyObject *tree_find_matches_by_tier(KvTree *self, PyObject *hashes) {
    PyObject *host = NULL;
    PyObject *device = walk(self, hashes, &host);
    if (device == NULL) return NULL;
    PyObject *both = PyTuple_Pack(2, device, host);
    Py_DECREF(device);
    Py_DECREF(host);
    return both;
}
