// Package browsertest drives the operator UI (idemui) in headless Chromium
// from Go tests, with chromedp: a module of its own, so that chromedp is a
// requirement of no published module. Its tests need PostgreSQL and
// Debian's chromium package (.ci/run installs it); they fail, never skip,
// without either.
package browsertest
