import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.Random;

/**
 * Prints java.util.Random(seed).nextInt(bound), count times, for every input line "seed bound count", so the
 * tests can compare Flink's ShufflePartitioner sequence with the vectorised Python one.
 */
public final class JavaRandomInts {
    public static void main(String[] args) throws Exception {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.US_ASCII));
        StringBuilder out = new StringBuilder();
        String line;
        while ((line = in.readLine()) != null) {
            if (line.isEmpty()) {
                continue;
            }
            String[] parts = line.trim().split(" ");
            Random random = new Random(Long.parseLong(parts[0]));
            int bound = Integer.parseInt(parts[1]);
            int count = Integer.parseInt(parts[2]);
            for (int i = 0; i < count; i++) {
                out.append(random.nextInt(bound)).append(i + 1 < count ? ' ' : '\n');
            }
        }
        System.out.print(out);
    }
}
