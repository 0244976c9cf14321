/* services.routing.native._kvtree: the KvIndex semantics (services/routing/kv_index.py) in C.
   NativeRadixTree (native_radix_tree.py) is the typed face; this file applies events and walks
   prompts over the nodes of tree_core.h.

Workers: a dict maps each worker (any hashable) to a record of its two holder slots, device and
host (HostCopy in the Python index). A record outlives its worker while nodes still carry one of
its slots' bits (stale marks a re-stored block hash left), and a returning worker gets it back,
so those marks count for that worker and never for a newcomer: the reference index keys holders
by name and does the same. A slot is reused once its worker is gone and no node carries its bit.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "tree_core.h"

#ifdef __GLIBC__
#include <malloc.h>
#endif

typedef struct {
    PyObject *name;
    int32_t slot[2]; /* device, host; -1 when none */
    int removed;
} Record;

typedef struct {
    PyObject_HEAD
    Tree t;
    PyObject *names; /* worker -> record index */
    Record *recs;
    uint32_t nrecs, caprecs;
    int32_t free_rec; /* free records (name NULL), linked through slot[0]; -1 ends the list */
    uint32_t *counts; /* per slot, scratch for the walk */
} KvTree;

static PyObject *EventError, *KIND_UNKNOWN_PARENT, *KIND_CONTRADICTS_TREE, *KIND_BAD_HASH;

static KvTree *owner_of(Tree *t) { return (KvTree *)((char *)t - offsetof(KvTree, t)); }

/* -- workers and their slots ------------------------------------------------------------- */

static void free_record_if_unused(KvTree *self, int32_t r) {
    Record *rec = &self->recs[r];
    if (rec->name == NULL || !rec->removed || rec->slot[0] >= 0 || rec->slot[1] >= 0) return;
    PyObject *name = rec->name;
    rec->name = NULL;
    rec->slot[0] = self->free_rec;
    self->free_rec = r;
    if (PyDict_DelItem(self->names, name) < 0) PyErr_Clear();
    Py_DECREF(name);
}

static void maybe_free_slot(KvTree *self, uint32_t s) {
    Slot *slot = &self->t.slots[s];
    if (slot->record < 0 || slot->marks || slot->table.count) return;
    Record *rec = &self->recs[slot->record];
    if (!rec->removed) return;
    int32_t r = slot->record;
    rec->slot[slot->host] = -1;
    slot->record = -1;
    free_record_if_unused(self, r);
}

static void slot_unmarked(Tree *t, uint32_t s) { maybe_free_slot(owner_of(t), s); }

/* The record of `name`, made when `create`; -1 when none (or on error, with an exception). */
static int32_t record_of(KvTree *self, PyObject *name, int create) {
    PyObject *found = PyDict_GetItemWithError(self->names, name);
    if (found != NULL) return (int32_t)PyLong_AsLong(found);
    if (PyErr_Occurred() || !create) return -1;
    uint32_t r;
    if (self->free_rec >= 0) {
        r = (uint32_t)self->free_rec;
        self->free_rec = self->recs[r].slot[0];
    } else {
        if (self->nrecs == self->caprecs) {
            if (self->caprecs >= (uint32_t)INT32_MAX / 2) { PyErr_NoMemory(); return -1; }
            uint32_t cap = self->caprecs ? self->caprecs * 2 : 16;
            Record *recs = PyMem_Realloc(self->recs, sizeof(Record) * cap);
            if (recs == NULL) { PyErr_NoMemory(); return -1; }
            self->recs = recs;
            self->caprecs = cap;
        }
        r = self->nrecs++;
    }
    PyObject *index = PyLong_FromUnsignedLong(r);
    if (index == NULL || PyDict_SetItem(self->names, name, index) < 0) {
        Py_XDECREF(index);
        self->recs[r] = (Record){NULL, {self->free_rec, -1}, 0};
        self->free_rec = (int32_t)r;
        return -1;
    }
    Py_DECREF(index);
    Py_INCREF(name);
    self->recs[r] = (Record){name, {-1, -1}, 0};
    return (int32_t)r;
}

/* The slot of a worker's tier, made (and the worker known again) when `create`. */
static int32_t slot_of(KvTree *self, PyObject *name, int host, int create) {
    int32_t r = record_of(self, name, create);
    if (r < 0) return -1;
    if (create) self->recs[r].removed = 0;
    int32_t s = self->recs[r].slot[host];
    if (s >= 0 || !create) return s;
    Tree *t = &self->t;
    uint32_t free_slot = 0;
    while (free_slot < t->nslots && t->slots[free_slot].record >= 0) free_slot++;  /* lowest first */
    if (free_slot == t->capslots) {
        if (t->capslots >= (uint32_t)INT32_MAX / 2) { PyErr_NoMemory(); return -1; }
        uint32_t cap = t->capslots ? t->capslots * 2 : 64;
        Slot *slots = PyMem_Realloc(t->slots, sizeof(Slot) * cap);
        uint32_t *counts = PyMem_Realloc(self->counts, sizeof(uint32_t) * 2 * cap);
        if (slots) t->slots = slots;
        if (counts) self->counts = counts;
        if (!slots || !counts) { PyErr_NoMemory(); return -1; }
        memset(self->counts, 0, sizeof(uint32_t) * 2 * cap);
        t->capslots = cap;
    }
    if (ensure_mask_width(t, free_slot + 1) != 0) { PyErr_NoMemory(); return -1; }
    if (free_slot == t->nslots) t->nslots++;
    t->slots[free_slot] = (Slot){{NULL, 0, 0}, 0, r, (uint8_t)host};
    self->recs[r].slot[host] = (int32_t)free_slot;
    return (int32_t)free_slot;
}

/* -- events ------------------------------------------------------------------------------ */

static int read_u64(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o)) return -1;
    *out = PyLong_AsUnsignedLongLong(o);
    if (*out == (uint64_t)-1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
    return 0;
}

static PyObject *event_error(PyObject *kind, PyObject *message) {
    if (message == NULL) return NULL;
    if (EventError == NULL || kind == NULL) {  /* native_radix_tree.py configures it at import */
        Py_DECREF(message);
        PyErr_SetString(PyExc_RuntimeError, "_kvtree.configure() was not called: use NativeRadixTree");
        return NULL;
    }
    PyObject *exc = PyObject_CallFunctionObjArgs(EventError, kind, message, NULL);
    Py_DECREF(message);
    if (exc != NULL) {
        PyErr_SetObject(EventError, exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static PyObject *tree_store(KvTree *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "store(worker, parent_hash, blocks, host)");
    PyObject *name = args[0], *parent = args[1];
    int host = PyObject_IsTrue(args[3]);
    if (host < 0) return NULL;
    Tree *t = &self->t;
    int32_t s = slot_of(self, name, host, 1);
    if (s < 0) return NULL;
    uint32_t cur = ROOT;
    if (parent != Py_None) {
        uint64_t ph;
        cur = 0;
        if (read_u64(parent, &ph) == 0) {
            cur = map_get(&t->slots[s].table, ph);
            int32_t device = self->recs[t->slots[s].record].slot[0];
            /* A host block's parent may still be on the device; a device block's is there. */
            if (!cur && host && device >= 0) cur = map_get(&t->slots[device].table, ph);
        }
        if (!cur)
            return event_error(KIND_UNKNOWN_PARENT,
                               PyUnicode_FromFormat("worker %S: parent block %S unknown; store skipped", name, parent));
    }
    PyObject *seq = PySequence_Fast(args[2], "blocks must be iterable");
    if (seq == NULL) return NULL;
    Py_ssize_t total = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t applied = 0;
    PyObject *failed = NULL; /* the error's kind, when one stops the loop */
    uint64_t bh = 0;
    for (; applied < total; applied++) {
        PyObject *item = items[applied];
        uint64_t th;
        PyObject **pair = PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2 ? &PyTuple_GET_ITEM(item, 0)
                          : PyList_Check(item) && PyList_GET_SIZE(item) == 2 ? &PyList_GET_ITEM(item, 0) : NULL;
        if (pair == NULL || read_u64(pair[0], &bh) != 0 || read_u64(pair[1], &th) != 0) {
            failed = KIND_BAD_HASH;
            break;
        }
        uint32_t child = find_child(t, cur, th);
        int link = child == 0;
        /* A block hash the worker already has: its node, with every holder still on it, re-linked
           here rather than duplicated. */
        if (link) child = map_get(&t->slots[s].table, bh);
        if (child && child == cur) {  /* before linking: a self-link would repeat this block in every walk */
            failed = KIND_CONTRADICTS_TREE;
            break;
        }
        /* What can fail first, so that a block is applied whole or not at all (see Tree). */
        if (map_reserve(&t->slots[s].table, 1) != 0) {
            t->err = TREE_NOMEM;
            break;
        }
        if (link) {
            int fresh = child == 0;
            if (fresh && !(child = new_node(t, th))) break;
            if (link_child(t, cur, th, child) != 0) {
                if (fresh) discard_node(t, child);
                break;
            }
        }
        if (!has_bit(t, child, (uint32_t)s)) {
            flip_bit(t, child, (uint32_t)s);
            t->slots[s].marks++;
        }
        int oom = 0;
        uint32_t previous = map_put(&t->slots[s].table, bh, child, &oom);  /* cannot fail: room made */
        if (previous != child) {
            t->nodes[child].refs++;
            if (previous) release(t, previous);
        }
        cur = child;
    }
    Py_DECREF(seq);
    if (failed == KIND_BAD_HASH)
        return event_error(failed, PyUnicode_FromFormat(
            "worker %S: a block hash is not a 64-bit unsigned int; rest of the store skipped", name));
    if (failed == KIND_CONTRADICTS_TREE)
        return event_error(failed, PyUnicode_FromFormat(
            "worker %S: block %llu refers to itself; rest of the store skipped", name, (unsigned long long)bh));
    if (applied < total) {
        int full = t->err == TREE_FULL;
        t->err = 0;
        if (full)
            return PyErr_Format(PyExc_OverflowError, "worker %S: the native KV index is full (2^31 nodes or child maps); "
                                "rest of the store skipped", name);
        return PyErr_NoMemory();
    }
    return PyLong_FromSsize_t(applied);
}

static PyObject *tree_remove(KvTree *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "remove(worker, block_hashes, host)");
    int host = PyObject_IsTrue(args[2]);
    if (host < 0) return NULL;
    int32_t s = slot_of(self, args[0], host, 0);
    if (s < 0) {
        if (PyErr_Occurred()) return NULL;
        return PyLong_FromLong(0);
    }
    PyObject *seq = PySequence_Fast(args[1], "block_hashes must be iterable");
    if (seq == NULL) return NULL;
    Tree *t = &self->t;
    Py_ssize_t removed = 0, total = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < total; i++) {
        uint64_t bh;
        uint32_t node;
        if (read_u64(items[i], &bh) != 0 || !(node = map_del(&t->slots[s].table, bh))) continue;
        removed++;
        let_go(t, (uint32_t)s, node);
        release(t, node);
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(removed);
}

/* A holder lets go of every block it holds (the lookup first, then each node). Allocates
   nothing, so it cannot stop half-way. */
static void drop_blocks(KvTree *self, uint32_t s) {
    Tree *t = &self->t;
    Map table = t->slots[s].table;  /* detached: let_go and release never see it */
    t->slots[s].table = (Map){NULL, 0, 0};
    for (uint32_t i = 0; i < table.cap; i++)
        if (table.e[i].value) let_go(t, s, table.e[i].value);
    for (uint32_t i = 0; i < table.cap; i++)
        if (table.e[i].value) release(t, table.e[i].value);
    map_free(&table);
}

static int forget(KvTree *self, PyObject *name, int remove) {
    int32_t r = record_of(self, name, 0);
    if (r < 0) return PyErr_Occurred() ? -1 : 0;
    for (int host = 0; host < 2; host++) {
        int32_t s = self->recs[r].slot[host];
        if (s >= 0) drop_blocks(self, (uint32_t)s);
    }
    if (remove) {
        self->recs[r].removed = 1;
        for (int host = 0; host < 2; host++) {
            int32_t s = self->recs[r].slot[host];
            if (s >= 0) maybe_free_slot(self, (uint32_t)s);
        }
        free_record_if_unused(self, r);
    }
    return 0;
}

static PyObject *tree_clear(KvTree *self, PyObject *name) {
    if (forget(self, name, 0) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *tree_remove_worker(KvTree *self, PyObject *name) {
    if (forget(self, name, 1) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *tree_block_count(KvTree *self, PyObject *name) {
    Tree *t = &self->t;
    uint64_t total = 0;
    if (name == Py_None) {
        for (uint32_t s = 0; s < t->nslots; s++) total += t->slots[s].table.count;
        return PyLong_FromUnsignedLongLong(total);
    }
    int32_t s = slot_of(self, name, 0, 0);
    if (s < 0 && PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLong(s < 0 ? 0 : t->slots[s].table.count);
}

static PyObject *tree_node_count(KvTree *self, PyObject *unused) {
    return PyLong_FromUnsignedLong(self->t.live);
}

#include "kvtree_walk.h"

static PyMethodDef tree_methods[] = {
    {"store", (PyCFunction)(void (*)(void))tree_store, METH_FASTCALL, "store(worker, parent_hash, blocks, host) -> int"},
    {"remove", (PyCFunction)(void (*)(void))tree_remove, METH_FASTCALL, "remove(worker, block_hashes, host) -> int"},
    {"clear", (PyCFunction)tree_clear, METH_O, "clear(worker)"},
    {"remove_worker", (PyCFunction)tree_remove_worker, METH_O, "remove_worker(worker)"},
    {"block_count", (PyCFunction)tree_block_count, METH_O, "block_count(worker or None) -> int"},
    {"node_count", (PyCFunction)tree_node_count, METH_NOARGS, "live nodes, the root included"},
    {"find_matches", (PyCFunction)tree_find_matches, METH_O, "find_matches(local_hashes) -> dict"},
    {"find_matches_by_tier", (PyCFunction)tree_find_matches_by_tier, METH_O,
     "find_matches_by_tier(local_hashes) -> (dict, dict)"},
    {NULL, NULL, 0, NULL},
};

static int tree_init(KvTree *self, PyObject *args, PyObject *kwds) {
    if (self->names != NULL) return 0;
    self->names = PyDict_New();
    if (self->names == NULL) return -1;
    Tree *t = &self->t;
    t->free_head = UNKNOWN;
    t->free_map = UNKNOWN;
    self->free_rec = -1;
    uint32_t root = new_node(t, 0);
    if (root != ROOT || t->nodes == NULL) { PyErr_NoMemory(); return -1; }
    t->nodes[ROOT].refs = 1; /* the root is never freed */
    return 0;
}

static void tree_dealloc(KvTree *self) {
    Tree *t = &self->t;
    for (uint32_t s = 0; s < t->nslots; s++) map_free(&t->slots[s].table);
    for (uint32_t m = 0; m < t->nmaps; m++) map_free(&t->maps[m]);
    free(t->maps);
    region_free(t->nodes, (size_t)t->cap * sizeof(Node));
    region_free(t->ext, (size_t)t->extcap * t->extw * sizeof(uint64_t));
    PyMem_Free(t->slots);
    PyMem_Free(self->counts);
    for (uint32_t r = 0; r < self->nrecs; r++) Py_XDECREF(self->recs[r].name);
    PyMem_Free(self->recs);
    Py_XDECREF(self->names);
    Py_TYPE(self)->tp_free((PyObject *)self);
#ifdef __GLIBC__
    malloc_trim(0); /* the small child maps' heap pages go back too, not only the mapped arrays */
#endif
}

static PyTypeObject KvTreeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "services.routing.native._kvtree.Tree",
    .tp_basicsize = sizeof(KvTree),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The radix tree of every worker's cached blocks (see kv_index.KvIndex).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)tree_init,
    .tp_dealloc = (destructor)tree_dealloc,
    .tp_methods = tree_methods,
};

/* configure(EventError, unknown_parent, contradicts_tree, bad_hash): the Python error type and
   kinds the tree raises, from services.routing.kv_index (passed in: no import from C). */
static PyObject *configure(PyObject *module, PyObject *args) {
    PyObject *e, *a, *b, *c;
    if (!PyArg_ParseTuple(args, "OOOO", &e, &a, &b, &c)) return NULL;
    Py_XSETREF(EventError, Py_NewRef(e));
    Py_XSETREF(KIND_UNKNOWN_PARENT, Py_NewRef(a));
    Py_XSETREF(KIND_CONTRADICTS_TREE, Py_NewRef(b));
    Py_XSETREF(KIND_BAD_HASH, Py_NewRef(c));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", configure, METH_VARARGS, "configure(EventError, unknown_parent, contradicts_tree, bad_hash)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef kvtree_module = {PyModuleDef_HEAD_INIT, "_kvtree", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__kvtree(void) {
    if (PyType_Ready(&KvTreeType) < 0) return NULL;
    PyObject *m = PyModule_Create(&kvtree_module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Tree", (PyObject *)&KvTreeType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#ifndef KVTREE_SOURCES
#define KVTREE_SOURCES ""
#endif
    /* The digest of the sources this was built from: the Python side refuses a stale build. */
    if (PyModule_AddStringConstant(m, "SOURCES", KVTREE_SOURCES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
