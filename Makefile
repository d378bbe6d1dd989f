# Installing kvr: the `kvr` binary, libkvr (static and shared), the C and C++ headers, a
# pkg-config file and a CMake package.
#
#   make install PREFIX=/opt/kvr   # builds (cargo, --locked) then installs under PREFIX
#   make dist                      # dist/kvr-VERSION-TRIPLE.tar.gz, the same layout
#   make uninstall PREFIX=/opt/kvr
#
# Layout under PREFIX:
#   bin/kvr
#   include/kvr.h include/kvr.hpp
#   lib/libkvr.a lib/libkvr.so.ABI lib/libkvr.so -> libkvr.so.ABI   (SONAME libkvr.so.ABI)
#   lib/pkgconfig/kvr.pc (links libkvr.so) lib/pkgconfig/kvr-static.pc (links libkvr.a)
#   lib/cmake/kvr/kvrConfig.cmake lib/cmake/kvr/kvrConfigVersion.cmake
#   share/doc/kvr/README.md LICENSE CHANGELOG.md, share/doc/kvr/docs/ (the user guides)
# ABI is KVR_ABI_VERSION (include/kvr.h): it changes with every incompatible ABI change.
#
# Variables: PREFIX (/usr/local), DESTDIR (staging root, empty), PROFILE (cargo profile:
# release, reusing the suite's build, or dist: smaller, a separate LTO build of ~8 min),
# CARGO_TARGET_DIR (honoured, default target/), CARGO, STRIP.
# Installed libraries and binaries are stripped of debug info (`strip --strip-debug`): a
# release libkvr.a carries the line tables of every crate, the standard library's included.
# Sizes (x86_64, 0.4.0): libkvr.a 100.7 MB built with the release profile, 30.9 MB
# installed; with PROFILE=dist (fat LTO, no debug info; what `make dist` uses) 8.5 MB
# installed, libkvr.so 3.2 MB, kvr 6.6 MB.

PREFIX ?= /usr/local
DESTDIR ?=
PROFILE ?= release
CARGO ?= cargo
STRIP ?= strip
CARGO_TARGET_DIR ?= $(CURDIR)/target

VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
VERSION_MAJOR := $(word 1,$(subst ., ,$(VERSION)))
VERSION_MINOR := $(word 2,$(subst ., ,$(VERSION)))
ABI := $(shell sed -n 's/^\#define KVR_ABI_VERSION \([0-9][0-9]*\)$$/\1/p' include/kvr.h)
TRIPLE := $(shell rustc -vV 2>/dev/null | sed -n 's/^host: //p')
# cargo puts the dev and release profiles in their own directories, others by name.
PROFILE_DIR := $(if $(filter dev,$(PROFILE)),debug,$(PROFILE))
BUILD := $(CARGO_TARGET_DIR)/$(PROFILE_DIR)
SONAME := libkvr.so.$(ABI)

ROOT := $(DESTDIR)$(PREFIX)
SUBST := sed -e 's|@VERSION@|$(VERSION)|g' -e 's|@MAJOR@|$(VERSION_MAJOR)|g' \
	-e 's|@MINOR@|$(VERSION_MINOR)|g' -e 's|@ABI@|$(ABI)|g'

DIST_NAME := kvr-$(VERSION)-$(TRIPLE)

.PHONY: all build install uninstall dist check-vars clean-dist

all: build

check-vars:
	@test -n "$(VERSION)" || { echo "make: no version in Cargo.toml" >&2; exit 1; }
	@test -n "$(ABI)" || { echo "make: no KVR_ABI_VERSION in include/kvr.h" >&2; exit 1; }

build: check-vars
	CARGO_TARGET_DIR="$(CARGO_TARGET_DIR)" $(CARGO) build --locked --profile $(PROFILE) -p libkvr -p kvr-cli

install: build
	install -d "$(ROOT)/bin" "$(ROOT)/include" "$(ROOT)/lib/pkgconfig" "$(ROOT)/lib/cmake/kvr" \
		"$(ROOT)/share/doc/kvr/docs"
	install -m 0755 "$(BUILD)/kvr" "$(ROOT)/bin/kvr"
	install -m 0644 include/kvr.h include/kvr.hpp "$(ROOT)/include/"
	install -m 0644 "$(BUILD)/libkvr.a" "$(ROOT)/lib/libkvr.a"
	install -m 0755 "$(BUILD)/libkvr.so" "$(ROOT)/lib/$(SONAME)"
	$(STRIP) --strip-debug "$(ROOT)/bin/kvr" "$(ROOT)/lib/libkvr.a" "$(ROOT)/lib/$(SONAME)"
	ln -sfn "$(SONAME)" "$(ROOT)/lib/libkvr.so"
	$(SUBST) packaging/kvr.pc.in >"$(ROOT)/lib/pkgconfig/kvr.pc"
	$(SUBST) packaging/kvr-static.pc.in >"$(ROOT)/lib/pkgconfig/kvr-static.pc"
	$(SUBST) packaging/kvrConfig.cmake.in >"$(ROOT)/lib/cmake/kvr/kvrConfig.cmake"
	$(SUBST) packaging/kvrConfigVersion.cmake.in >"$(ROOT)/lib/cmake/kvr/kvrConfigVersion.cmake"
	install -m 0644 README.md LICENSE CHANGELOG.md "$(ROOT)/share/doc/kvr/"
	install -m 0644 docs/*.md docs/*.svg "$(ROOT)/share/doc/kvr/docs/"
	@echo "installed kvr $(VERSION) (C ABI $(ABI)) under $(ROOT)"

uninstall:
	rm -f "$(ROOT)/bin/kvr" "$(ROOT)/include/kvr.h" "$(ROOT)/include/kvr.hpp" \
		"$(ROOT)/lib/libkvr.a" "$(ROOT)/lib/$(SONAME)" "$(ROOT)/lib/libkvr.so" \
		"$(ROOT)/lib/pkgconfig/kvr.pc" "$(ROOT)/lib/pkgconfig/kvr-static.pc" \
		"$(ROOT)/lib/cmake/kvr/kvrConfig.cmake" \
		"$(ROOT)/lib/cmake/kvr/kvrConfigVersion.cmake"
	rm -rf "$(ROOT)/share/doc/kvr"
	-rmdir "$(ROOT)/lib/cmake/kvr" 2>/dev/null

# The install layout under dist/$(DIST_NAME)/, packed as dist/$(DIST_NAME).tar.gz
# (relocatable: kvr.pc and kvrConfig.cmake find the prefix from their own location).
dist: PROFILE = dist
dist: check-vars
	rm -rf "dist/$(DIST_NAME)" "dist/$(DIST_NAME).tar.gz"
	$(MAKE) install PROFILE=$(PROFILE) DESTDIR= PREFIX="$(CURDIR)/dist/$(DIST_NAME)"
	tar -C dist -czf "dist/$(DIST_NAME).tar.gz" "$(DIST_NAME)"
	@echo "dist/$(DIST_NAME).tar.gz"

clean-dist:
	rm -rf dist
