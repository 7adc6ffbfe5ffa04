// Package providertest checks idem's verifying presets against the
// providers' own signing libraries: stripe-go's test signer and the
// Standard Webhooks library. It is a module of its own, for tests only, so
// that the library's go.mod never pulls those libraries on its users.
package providertest
