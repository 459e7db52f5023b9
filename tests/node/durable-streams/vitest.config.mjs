import { defineConfig } from "vitest/config"

// Some TTL tests take 3-4 s against vitest's default 5 s: room for a loaded machine.
export default defineConfig({
  test: { include: ["conformance.test.mjs"], testTimeout: 30000, hookTimeout: 30000 },
})
