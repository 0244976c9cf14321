# kvmesh — disaggregated LLM serving with KV-aware routing.
SHELL := /bin/bash
PY    ?= python3
VENV  := .venv
VPY   := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO_FILES := $(wildcard protos/kvmesh/v1/*.proto)
NATIVE_SRC := $(wildcard services/routing/native/*.c services/routing/native/*.h)
NATIVE_STAMP := services/routing/native/.built
# The demo model (services/tools/make_demo_model.py; its kvmesh_demo.json records the spec it was
# built from) and its two random LoRA adapters (services/tools/make_demo_adapter.py; the second is
# written last, so its config stands for both).
DEMO_MODEL := .cache/models/kvmesh-demo/kvmesh_demo.json
DEMO_ADAPTERS := .cache/models/kvmesh-demo-lora-b/adapter_config.json
# The demo vision-language model (services/tools/make_demo_vlm.py): `make run ARGS="--model
# .cache/models/kvmesh-demo-vlm"` serves images.
DEMO_VLM := .cache/models/kvmesh-demo-vlm/config.json

.PHONY: install run test test-unit protos bench chaos lint clean

install: $(STAMP) $(NATIVE_STAMP) $(DEMO_MODEL) $(DEMO_ADAPTERS) $(DEMO_VLM)

$(STAMP): requirements.txt scripts/install.sh
	bash scripts/install.sh
	touch $@

# The router's native KV index, rebuilt when its C sources change. Where it cannot be built the
# router runs the Python radix tree (services/routing/index_choice.py), so `make run` goes on; the
# tests set KVMESH_REQUIRE_NATIVE=1, so a machine that cannot build it fails `make test` instead
# of quietly testing the fallback alone.
$(NATIVE_STAMP): $(NATIVE_SRC) | $(STAMP)
	-$(VPY) -m services.routing.native.build && touch $@

# The demo model and its LoRA adapters, made at install (and by the launcher on first use if they
# were removed since): `make run` serves both adapters beside the model (--demo-lora). Whenever
# make_demo_model.py changed since, the model is checked again and rebuilt if its spec is not the
# current one (a new context length: the adapters, which depend on the shapes alone, stay).
$(DEMO_MODEL): services/tools/make_demo_model.py | $(STAMP)
	$(VPY) -m services.tools.make_demo_model >/dev/null
	touch $@

$(DEMO_ADAPTERS): | $(DEMO_MODEL)
	$(VPY) -m services.tools.make_demo_adapter >/dev/null

$(DEMO_VLM): services/tools/make_demo_vlm.py services/tools/make_demo_model.py | $(STAMP)
	$(VPY) -m services.tools.make_demo_vlm >/dev/null

# --demo-lora: with the demo model and no --lora-modules in ARGS, the workers also serve the demo
# adapters demo-lora-a and demo-lora-b (request one by naming it as the model).
run: install
	$(VPY) -m services.launch --demo-lora $(ARGS)

test: install
	KVMESH_REQUIRE_NATIVE=1 $(VPY) -m pytest $(PYTEST_ARGS)

# The tests that start nothing (tests/unit/) and need no vLLM import, with a tenth of the
# property tests' random search (tests/unit/budget.py): seconds, for the edit-test loop.
# The pytest plugins are named rather than found: a plugin found through its package has every
# module of that package (all of hypothesis and anyio) compiled through pytest's assertion
# rewriter, a second each run where no bytecode is kept. Schemathesis's is left out (unused here).
UNIT_PLUGINS := -p pytest_asyncio.plugin -p pytest_timeout -p _hypothesis_pytestplugin -p anyio.pytest_plugin
test-unit: install
	PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 KVMESH_REQUIRE_NATIVE=1 KVMESH_QUICK_PROPERTIES=1 \
		$(VPY) -m pytest tests/unit -m "not vllm" $(UNIT_PLUGINS) $(PYTEST_ARGS)

protos: install
	$(VPY) -m grpc_tools.protoc -I protos --python_out=gen --grpc_python_out=gen --pyi_out=gen $(PROTO_FILES)
	@# protoc writes imports relative to the proto root; the generated code lives in package `gen`.
	sed -i -E 's/^from kvmesh\.v1 import/from gen.kvmesh.v1 import/' gen/kvmesh/v1/*.py gen/kvmesh/v1/*.pyi

bench: install
	$(VPY) -m bench $(ARGS)

# Streaming load on a disaggregated mocker mesh while its processes are killed (bench/chaos/).
chaos: install
	$(VPY) -m bench.chaos $(ARGS)

lint: install
	$(VPY) -m ruff check services testkit tests bench
	$(VPY) -m mypy services testkit

clean:
	rm -rf $(VENV) .pytest_cache
